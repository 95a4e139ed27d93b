"""Static (preallocated) KV caches: `KVCache` (one shared length for its batch rows) takes blocks of
tokens and keeps a chosen subset of a block; `SlotCache` (continuous batching) holds a slot per
sequence, each with its own length.

Layout: keys and values [num_layers, batch, num_kv_heads, max_len, head_dim]. Slot i holds the token
whose KV was written i-th; `length` slots are live. A forward writes its block at [length, length+T)
and then `advance(T)`; after tree verification `keep(start, kept)` compacts the accepted nodes of the
block to [start, start+len(kept)) in order. Nothing is reallocated after construction.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import NamedTuple, Optional

import torch

from ..errors import InputError


def check_room(length: int, num_new: int, max_len: int) -> None:
    """Raise InputError when `num_new` more tokens do not fit after `length` cached ones."""
    if length + num_new > max_len:
        raise InputError(
            f"KV cache overflow: {length} cached + {num_new} new tokens > max_len "
            f"{max_len}. Shorten the prompt or max_new_tokens, or raise --max-model-len.")


class KVCache:
    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, max_len: int,
                 batch: int = 1, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu"):
        shape = (num_layers, batch, num_kv_heads, max_len, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        # each layer's views, made once (indexing them anew costs time in every forward)
        self._layers = [(self.k[i], self.v[i]) for i in range(num_layers)]
        self.max_len = max_len
        self.length = 0

    @classmethod
    def over(cls, k: torch.Tensor, v: torch.Tensor, length: int) -> "KVCache":
        """A cache on existing buffers k, v [num_layers, batch, num_kv_heads, max_len, head_dim]
        (views: what it writes lands in them), holding `length` tokens."""
        cache = cls.__new__(cls)
        cache.k, cache.v = k, v
        cache._layers = [(k[i], v[i]) for i in range(k.shape[0])]
        cache.max_len, cache.length = k.shape[3], length
        return cache

    @property
    def batch(self) -> int:
        return self.k.shape[1]

    def layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self._layers[i]

    def check_room(self, num_new: int) -> None:
        check_room(self.length, num_new, self.max_len)

    def advance(self, num_new: int) -> None:
        self.check_room(num_new)
        self.length += num_new

    def truncate(self, length: int) -> None:
        if not 0 <= length <= self.length:
            raise ValueError(f"truncate to {length} outside [0, {self.length}]")
        self.length = length

    def keep(self, start: int, kept: torch.Tensor) -> None:
        """Keep only block slots `start + kept` (sorted, relative to start), compacted to start.."""
        n = int(kept.numel())
        src = kept.to(self.k.device) + start
        self.k[:, :, :, start:start + n] = self.k.index_select(3, src)
        self.v[:, :, :, start:start + n] = self.v.index_select(3, src)
        self.length = start + n

    def reset(self) -> None:
        self.length = 0

    def take_rows(self, rows: torch.Tensor) -> "KVCache":
        """A new cache of batch rows `rows` (same max_len, dtype, device) holding their live slots."""
        num_layers, _, num_kv_heads, max_len, head_dim = self.k.shape
        out = KVCache(num_layers, num_kv_heads, head_dim, max_len, len(rows), self.k.dtype, self.k.device)
        live = slice(0, self.length)
        out.k[:, :, :, live] = self.k[:, rows, :, live]
        out.v[:, :, :, live] = self.v[:, rows, :, live]
        out.length = self.length
        return out


# ---------------------------------------------------------------------------- a slot per sequence
class Block(NamedTuple):
    slot: int
    start: int                  # the slot's cached length before this forward
    rows: int
    first_row: int              # its first row in the forward


class SlotRows(NamedTuple):
    """Where the rows of one batched forward come from and go (continuous batching).

    Row order: the blocks one after another; block i is `rows` consecutive tokens of the sequence
    in cache slot `slot`, written at [start, start + rows) of that slot (its cached length). A
    tree block (a request's last token and a tree of guesses, root first, parents before
    children) sees its slot's keys before it and, among its own rows, each row its ancestors and
    itself (`mask`), each row at position start + its depth."""
    slot: torch.Tensor          # [N] int64: the cache slot of each row
    index: torch.Tensor         # [N] int64: the cache row its k/v is written at
    keys: torch.Tensor          # [N] int64: it attends to keys [0, keys) of its slot (causal)
    positions: torch.Tensor     # [N] int64: its rotary position (= index for plain decoding)
    last: torch.Tensor          # [num_blocks] int64: each block's last row
    blocks: tuple[Block, ...]
    mask: Optional[torch.Tensor] = None   # [1, 1, N, max_len] bool where a block is a tree: row
                                          # t sees key s of its slot iff s < keys[t] and mask

    @property
    def num_rows(self) -> int:
        return int(self.slot.numel())


class SlotCache:
    """A static KV cache with one slot per sequence, each with its own length.

    Layout: keys and values [num_layers, slots, num_kv_heads, max_len, head_dim]; slot s holds
    `lengths[s]` live tokens. `allocate` hands out a free slot (length 0), `release` frees it at
    once; a forward over `plan(...)` rows writes each block at its slot's length and `commit`s.
    """

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, max_len: int,
                 slots: int, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"):
        if slots < 1:
            raise InputError(f"a slotted KV cache needs slots >= 1, got {slots}")
        shape = (num_layers, slots, num_kv_heads, max_len, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.max_len = max_len
        self.lengths = [0] * slots
        self.free = list(range(slots))          # handed out lowest first
        self.in_use: set[int] = set()

    @property
    def slots(self) -> int:
        return self.k.shape[1]

    @property
    def num_free(self) -> int:
        return len(self.free)

    def layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k[i], self.v[i]

    def allocate(self) -> int:
        if not self.free:
            raise InputError(f"no free KV cache slot: all {self.slots} are in use; release a "
                             "finished sequence first or build the cache with more slots")
        slot = self.free.pop(0)
        self.in_use.add(slot)
        self.lengths[slot] = 0
        return slot

    def release(self, slot: int) -> None:
        self._check_in_use(slot)
        self.in_use.remove(slot)
        self.free.append(slot)
        self.free.sort()
        self.lengths[slot] = 0

    def _check_in_use(self, slot: int) -> None:
        if slot not in self.in_use:
            raise InputError(f"KV cache slot {slot} is not in use (in use: {sorted(self.in_use)}); "
                             "allocate it first")

    def plan(self, blocks: list[tuple[int, int]], trees: Optional[dict[int, torch.Tensor]] = None) -> SlotRows:
        """Rows for one forward: `blocks` is (slot, num_new_tokens) per sequence, each slot once.
        trees: {block index: its ancestor matrix [rows, rows] bool (row i sees row j: j is i or an
        ancestor of i; row 0 the root)} for the blocks that are trees."""
        slots = [s for s, _ in blocks]
        if len(set(slots)) != len(slots):
            raise InputError(f"a slot appears twice in one forward: {slots}; give each sequence "
                             "one block")
        placed, first = [], 0
        for slot, rows in blocks:
            self._check_in_use(slot)
            if rows < 1:
                raise InputError(f"slot {slot}: a block needs >= 1 row, got {rows}")
            check_room(self.lengths[slot], rows, self.max_len)
            placed.append(Block(slot, self.lengths[slot], rows, first))
            first += rows
        planned = rows_of_blocks(placed, self.k.device)
        return with_trees(planned, trees, self.max_len) if trees else planned

    def load(self, slot: int, cache: KVCache, length: int) -> None:
        """Slot `slot` (empty) takes the first `length` tokens of a one-sequence cache, its k/v
        copied as they are: a sequence that decoded elsewhere joins the batch without a prefill."""
        if cache.batch != 1 or not 0 <= length <= cache.length:
            raise InputError(f"load takes up to the {cache.length} cached tokens of a one-sequence "
                             f"cache (batch {cache.batch}), got length {length}")
        self.write(slot, cache.k[:, 0, :, :length], cache.v[:, 0, :, :length])

    def write(self, slot: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """The empty `slot` takes rows k, v [num_layers, num_kv_heads, n, head_dim] as its first n."""
        self._check_in_use(slot)
        n = k.shape[2]
        if self.lengths[slot] != 0:
            raise InputError(f"KV cache slot {slot} holds {self.lengths[slot]} tokens; write into an "
                             "empty slot")
        want = (self.k.shape[0], self.k.shape[2], n, self.k.shape[4])
        if tuple(k.shape) != want or k.shape != v.shape or k.dtype != self.k.dtype:
            raise InputError(f"rows {tuple(k.shape)} {k.dtype} do not match the slots' layout "
                             f"{want} {self.k.dtype}")
        check_room(0, n, self.max_len)
        self.k[:, slot, :, :n] = k
        self.v[:, slot, :, :n] = v
        self.lengths[slot] = n

    def read(self, slot: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Copies of the slot's first n rows of k and v [num_layers, num_kv_heads, n, head_dim]."""
        self._check_in_use(slot)
        if not 0 <= n <= self.lengths[slot]:
            raise InputError(f"slot {slot} holds {self.lengths[slot]} tokens, asked for {n}")
        return self.k[:, slot, :, :n].clone(), self.v[:, slot, :, :n].clone()

    def view(self, slot: int) -> KVCache:
        """The slot as a one-sequence KVCache on the same buffers, at the slot's length (a forward
        on it writes into the slot; set_length(slot, view.length) after)."""
        self._check_in_use(slot)
        return KVCache.over(self.k[:, slot:slot + 1], self.v[:, slot:slot + 1], self.lengths[slot])

    def set_length(self, slot: int, length: int) -> None:
        """The slot holds `length` tokens (after a forward on its view)."""
        self._check_in_use(slot)
        check_room(0, length, self.max_len)
        self.lengths[slot] = length

    def truncate(self, slot: int, length: int) -> None:
        """The slot keeps its first `length` tokens (a checked chain's rows past the accepted
        ones go; the next forward writes over them)."""
        self._check_in_use(slot)
        if not 0 <= length <= self.lengths[slot]:
            raise InputError(f"slot {slot} holds {self.lengths[slot]} tokens; it cannot be cut to {length}")
        self.lengths[slot] = length

    def keep(self, slot: int, start: int, kept: list[int]) -> None:
        """After a tree block written at `start`: its rows `kept` (a root-to-node path, in order)
        become rows start, start + 1, ... and the slot ends after them."""
        self._check_in_use(slot)
        if any(not 0 <= r < self.lengths[slot] - start for r in kept):
            raise InputError(f"slot {slot}: kept rows {kept} lie outside its block of "
                             f"{self.lengths[slot] - start} rows at {start}")
        moved = [(i, r) for i, r in enumerate(kept) if r != i]
        if moved:
            src = torch.tensor([start + r for _, r in moved], device=self.k.device)
            dst = torch.tensor([start + i for i, _ in moved], device=self.k.device)
            for buf in (self.k, self.v):
                buf[:, slot, :, dst] = buf[:, slot, :, src]   # the index reads a copy first
        self.lengths[slot] = start + len(kept)

    def commit(self, rows: SlotRows) -> None:
        """The forward over `rows` has written its blocks: each slot's length moves past them."""
        for b in rows.blocks:
            self.lengths[b.slot] = b.start + b.rows


def rows_of_blocks(blocks: list[Block], device: torch.device | str = "cpu") -> SlotRows:
    """The per-row index tensors of placed blocks (plain causal decoding: position = index)."""
    slot = torch.cat([torch.full((b.rows,), b.slot, dtype=torch.long) for b in blocks])
    index = torch.cat([torch.arange(b.start, b.start + b.rows) for b in blocks])
    last = torch.tensor([b.first_row + b.rows - 1 for b in blocks], dtype=torch.long)
    return SlotRows(slot, index, index + 1, index.to(device), last, tuple(blocks))


def with_trees(rows: SlotRows, trees: dict[int, torch.Tensor], max_len: int) -> SlotRows:
    """`rows` with the given blocks as trees: their positions by depth, every row's keys up to the
    block's end, and the mask that keeps each tree row to its context and ancestors."""
    keys, positions = rows.keys.clone(), rows.positions.clone()
    mask = torch.arange(max_len)[None, :] < keys[:, None]       # the other blocks: causal
    for i, anc in trees.items():
        b = rows.blocks[i]
        if tuple(anc.shape) != (b.rows, b.rows):
            raise InputError(f"tree of block {i}: ancestor matrix {tuple(anc.shape)}, the block has "
                             f"{b.rows} rows")
        r = slice(b.first_row, b.first_row + b.rows)
        keys[r] = b.start + b.rows
        mask[r, :b.start] = True
        mask[r, b.start:b.start + b.rows] = anc.bool()
        positions[r] = b.start + anc.sum(dim=1).to(positions.device) - 1
    return rows._replace(keys=keys, positions=positions, mask=mask[None, None].to(rows.positions.device))


class PrefixStore:
    """The k/v of recent prompts, for a new prompt that starts with the same tokens (a shared
    system prompt, a chat's earlier turns): its slot takes those rows by copy instead of a prefill
    (what vLLM's automatic prefix caching and SGLang's radix cache do). Only for a row-stable
    layout, where a row's k/v depends on the tokens up to it and nothing else, so a copied row is
    the row a prefill would write, bit for bit.

    Entries: prompt tokens -> k, v [num_layers, num_kv_heads, n, head_dim], least recently used
    dropped first once they hold more than `max_tokens` tokens. Matching is token by token (the
    longest common prefix with any entry), linear in the entries' tokens.
    """

    def __init__(self, max_tokens: int):
        if max_tokens < 0:
            raise InputError(f"prefix cache tokens must be >= 0, got {max_tokens}")
        self.max_tokens = max_tokens
        self.entries: OrderedDict[tuple[int, ...], tuple[torch.Tensor, torch.Tensor]] = OrderedDict()
        self.tokens = 0

    def clear(self) -> None:
        self.entries.clear()
        self.tokens = 0

    def match(self, tokens: list[int], limit: int) -> tuple[int, Optional[tuple]]:
        """The longest prefix of `tokens` (at most `limit`) some entry holds: (length, key)."""
        best, best_key = 0, None
        for key in self.entries:
            n, top = 0, min(len(key), limit)
            while n < top and key[n] == tokens[n]:
                n += 1
            if n > best:
                best, best_key = n, key
        return best, best_key

    def load(self, cache: "SlotCache", slot: int, tokens: list[int], limit: int, least: int = 1) -> int:
        """Copy the longest stored prefix of `tokens` (at most `limit`, at least `least` tokens)
        into the empty `slot`; the tokens copied (0: none)."""
        n, key = self.match(tokens, limit)
        if n < max(least, 1):
            return 0
        k, v = self.entries[key]
        self.entries.move_to_end(key)
        cache.write(slot, k[:, :, :n], v[:, :, :n])
        return n

    def store(self, cache: "SlotCache", slot: int, tokens: list[int]) -> None:
        """Keep the k/v of `tokens`, the first len(tokens) rows of `slot`, unless an entry already
        holds them all (or they alone exceed the budget)."""
        n = len(tokens)
        if n == 0 or n > self.max_tokens or self.match(tokens, n)[0] == n:
            return
        k, v = cache.read(slot, n)
        self.entries[tuple(tokens)] = (k, v)
        self.tokens += n
        while self.tokens > self.max_tokens:
            old, _ = self.entries.popitem(last=False)
            self.tokens -= len(old)
