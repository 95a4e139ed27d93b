"""A request's Output without a model: the one emit/finish path of the Engine, the serial and the
batch schedulers (stop ids, max tokens, stop strings, draft flags, the result, cancellation)."""
from __future__ import annotations

from eagle3.generate import Output, SamplingParams
from eagle3.speculative.step import Step

EOS = 2


class CharTokenizer:
    """Token id i is the character chr(i): ids 97.. spell lowercase letters."""

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return "".join(chr(i) for i in ids if not (skip_special_tokens and i == EOS))


def ids(text: str) -> list[int]:
    return [ord(c) for c in text]


def run(steps: list[Step], **params) -> tuple[list, Output]:
    """Push steps until the output ends; the chunks and the Output."""
    out = Output(CharTokenizer(), SamplingParams(**params), {EOS}, prompt_tokens=3)
    chunks = []
    for step in steps:
        chunks.append(out.push(step))
        if out.done:
            break
    return chunks, out


def test_eos_ends_the_output_and_is_not_emitted():
    chunks, out = run([Step(ids("ab"), 1), Step(ids("c") + [EOS] + ids("d"), 1), Step(ids("e"), 0)])
    assert [c.token_ids for c in chunks] == [ids("ab"), ids("c")]
    assert [c.from_draft for c in chunks] == [[True, False], [True]]
    assert [c.finish_reason for c in chunks] == [None, "stop"] and chunks[0].result is None
    result = chunks[-1].result
    assert result.text == "abc" and result.token_ids == ids("abc") and result.finish_reason == "stop"
    assert result.prompt_tokens == 3 and len(result.steps) == 2 and result.ttft_s > 0
    assert [c.step for c in chunks] == result.steps


def test_max_new_tokens_cuts_inside_a_step_and_ignore_eos_emits_eos():
    chunks, out = run([Step(ids("ab"), 0), Step([EOS] + ids("cd"), 2)], max_new_tokens=4,
                      ignore_eos=True)
    assert chunks[-1].token_ids == [EOS, ord("c")] and chunks[-1].from_draft == [True, True]
    assert out.finish == "length" and out.ids == ids("ab") + [EOS, ord("c")]


def test_stop_token_ids_end_it_like_eos():
    chunks, out = run([Step(ids("abxc"), 3)], stop_token_ids=(ord("x"),))
    assert chunks[0].token_ids == ids("ab") and out.finish == "stop"


def test_a_stop_string_across_steps_cuts_the_text_and_holds_back_its_start():
    chunks, out = run([Step(ids("hello w"), 0), Step(ids("or"), 0), Step(ids("ld!"), 0)],
                      stop=("world",))
    assert [c.text for c in chunks] == ["hello ", "", ""]      # "w", "wor" could start the stop
    assert out.finish == "stop" and chunks[-1].result.text == "hello "
    assert chunks[-1].token_ids == ids("ld!")                  # tokens are emitted as stepped


def test_the_last_chunk_flushes_the_held_text():
    chunks, out = run([Step(ids("abc wo"), 0), Step(ids("rk"), 0)], stop=("world",),
                      max_new_tokens=8)
    assert [c.text for c in chunks] == ["abc ", "work"] and out.finish == "length"
    assert "".join(c.text for c in chunks) == chunks[-1].result.text


def test_cancel_ends_it_without_a_result():
    out = Output(CharTokenizer(), SamplingParams(), {EOS}, prompt_tokens=1)
    out.push(Step(ids("a"), 0))
    out.cancel()
    assert out.done and out.finish == "cancelled"
    out.cancel()
    assert out.finish == "cancelled"
