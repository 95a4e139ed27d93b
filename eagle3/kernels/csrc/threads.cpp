// parallel_threads: how many threads the kernels' parallel regions really get, so eagle3.kernels
// can report a build that lost OpenMP or linked a second runtime. It owns no kernel.
#include "kernels.h"

namespace eagle3 {

// how many distinct threads an at::parallel_for region here really gets (1 if the build lost
// OpenMP; more than torch.get_num_threads() if it linked a second OpenMP runtime)
int64_t parallel_threads() {
  constexpr int kMaxIds = 1024;
  std::vector<int> seen(kMaxIds, 0);
  at::parallel_for(0, (int64_t)std::max(1, at::get_num_threads()) * 64, 1, [&](int64_t, int64_t) {
    const int t = at::get_thread_num();
    seen[std::min(std::max(t, 0), kMaxIds - 1)] = 1;
  });
  int64_t n = 0;
  for (int v : seen) n += v;
  return n;
}

}  // namespace eagle3
