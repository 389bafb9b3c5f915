"""A prefix index keyed by page-sized token blocks, for `driver.generate(..., share_prefixes=True)`.

Block ``i`` of a token sequence is ``tokens[i * S:(i + 1) * S]`` (``S`` the
State's page size); its key hashes block ``i - 1``'s key together with its own
tokens (chained, as vLLM's prefix cache does), so one key names a whole run of
blocks from the start. The index maps each key to the live requests whose cache
holds that run; `PrefixIndex.match` finds the longest run of *full* blocks of a
new prompt that some holder still has, and checks the holder's tokens (a hash
collision can never hand out another prefix). `PrefixIndex.drop` forgets a
request when it is released.

It is host bookkeeping only: the pages stay the State's, shared through
``State.admit(rid, prefix_of=holder, tokens=n)``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from .checks import fail

_ROOT = hash(("fnattn.prefix_index", 0))


def block_keys(tokens: Sequence[int], block: int) -> list[int]:
    """Chained keys of the full ``block``-sized blocks of ``tokens``: key ``i`` covers ``tokens[:(i + 1) * block]``."""
    keys, parent = [], _ROOT
    for i in range(len(tokens) // block):
        parent = hash((parent, tuple(tokens[i * block:(i + 1) * block])))
        keys.append(parent)
    return keys


class PrefixIndex:
    """Hashes of page-sized token blocks -> the live requests holding them."""

    def __init__(self, block: int):
        if isinstance(block, bool) or not isinstance(block, int) or block <= 0:
            fail("PrefixIndex", "block", "a positive int (the State's page size)", block)
        self.block = block
        self._holders: dict[int, dict[int, None]] = {}  # key -> request ids (insertion ordered)
        self._tokens: dict[int, tuple[int, ...]] = {}  # request -> the tokens it was inserted with
        self._keys: dict[int, list[int]] = {}  # request -> its block keys

    def __contains__(self, request_id: int) -> bool:
        return request_id in self._tokens

    def __len__(self) -> int:
        return len(self._tokens)

    @property
    def num_blocks(self) -> int:
        """How many distinct block keys are indexed."""
        return len(self._holders)

    def insert(self, request_id: int, tokens: Sequence[int]) -> None:
        """Index the full blocks of ``tokens``, which request ``request_id`` holds in its cache from token 0."""
        if request_id in self._tokens:
            fail("PrefixIndex.insert", "request_id", "a request not already indexed", request_id)
        tokens = tuple(tokens)
        keys = block_keys(tokens, self.block)
        self._tokens[request_id], self._keys[request_id] = tokens, keys
        for k in keys:
            self._holders.setdefault(k, {})[request_id] = None

    def drop(self, request_id: int) -> None:
        """Forget a request (it was released); a request never indexed is ignored."""
        if request_id not in self._tokens:
            return
        del self._tokens[request_id]
        for k in self._keys.pop(request_id):
            holders = self._holders[k]
            del holders[request_id]
            if not holders:
                del self._holders[k]

    def match(self, tokens: Sequence[int], *, limit: int | None = None,
              usable: Callable[[int, int], bool] | None = None) -> tuple[int | None, int]:
        """The longest run of full blocks of ``tokens`` (at most ``limit`` tokens) an indexed request holds:
        ``-> (holder, tokens matched)``, ``(None, 0)`` if none. ``usable(holder, n)`` may refuse a holder for
        a match of ``n`` tokens (a State with recurrent layers shares only at the holder's cursor)."""
        tokens = tuple(tokens)
        S = self.block
        n_max = len(tokens) if limit is None else max(0, min(limit, len(tokens)))
        keys = block_keys(tokens[: n_max - n_max % S], S)
        # Every holder of block i's key holds blocks 0..i too: walk down from the longest run.
        for i in range(len(keys) - 1, -1, -1):
            n = (i + 1) * S
            for rid in self._holders.get(keys[i], ()):
                if self._tokens[rid][:n] == tokens[:n] and (usable is None or usable(rid, n)):
                    return rid, n
        return None, 0
