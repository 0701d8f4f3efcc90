"""SlotAllocator prefix caching: chained block hashes, shared ref-counted blocks, LRU eviction."""
from collections import OrderedDict

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from orca_ext.kv import KVCacheFullError, SlotAllocator, UnknownRequestError


def cached_request(alloc: SlotAllocator, request_id: int, tokens: list[int],
                   extra: int = 0) -> list[int]:
    """Allocate ``tokens`` reusing what is cached, then register all its full blocks."""
    hashes = alloc.block_hashes(tokens, extra)
    alloc.allocate(request_id, len(tokens), hashes)
    alloc.cache_blocks(request_id, hashes)
    return hashes


def test_block_hashes_chain_over_parent_tokens_and_extra_key():
    alloc = SlotAllocator(8, 4)
    tokens = list(range(10))
    hashes = alloc.block_hashes(tokens)
    assert len(hashes) == 2  # the partial last block gets no hash
    assert all(0 <= h < 2**64 for h in hashes) and hashes[0] != hashes[1]
    assert alloc.block_hashes(tokens[:8]) == hashes == alloc.block_hashes(tokens)
    assert alloc.block_hashes(tokens[4:8], parent=hashes[0]) == [hashes[1]]
    assert alloc.block_hashes(tokens[4:8]) != [hashes[1]]  # same tokens, other parent
    assert alloc.block_hashes(tokens[4:8], parent=hashes[0] ^ 1) != [hashes[1]]
    salted = alloc.block_hashes(tokens, extra_key=1)
    assert salted[0] != hashes[0] and salted[1] != hashes[1]
    changed = alloc.block_hashes([0, 1, 2, 3, 4, 5, 6, 99])
    assert changed[0] == hashes[0] and changed[1] != hashes[1]
    assert alloc.block_hashes(tokens[:3]) == [] and alloc.block_hashes([]) == []
    # Token order matters, and one block size's hashes differ from another's.
    assert alloc.block_hashes([1, 0, 2, 3])[0] != alloc.block_hashes([0, 1, 2, 3])[0]
    assert SlotAllocator(8, 2).block_hashes(tokens[:4])[1] != hashes[0]


def test_block_hashes_of_near_identical_blocks_are_distinct_and_well_mixed():
    alloc = SlotAllocator(8, 4)
    blocks = [[0, 0, 0, 0] for _ in range(4 * 2048)]
    for i, block in enumerate(blocks):
        block[i % 4] = i // 4 + 1  # one token differs from all zeros, at each position
    hashes = [alloc.block_hashes(b)[0] for b in blocks]
    hashes += [alloc.block_hashes([0, 0, 0, 0], extra_key=k)[0] for k in range(-1000, 1000)]
    assert len(set(hashes)) == len(hashes)
    ones = [sum(h >> bit & 1 for h in hashes) / len(hashes) for bit in range(64)]
    assert all(0.45 < p < 0.55 for p in ones)  # every bit is set about half the time


def test_reuse_of_the_longest_cached_prefix_and_two_holders():
    alloc = SlotAllocator(8, 4)
    a = cached_request(alloc, 1, list(range(12)))
    assert alloc.num_cached_blocks == 3 and alloc.shared_prefix_blocks(1) == 3
    b = alloc.block_hashes(list(range(8)) + [50, 51, 52, 53])
    assert b[:2] == a[:2] and b[2] != a[2]
    assert alloc.num_cached_prefix_blocks(b) == 2 and alloc.num_cached_prefix_blocks(a) == 3
    assert alloc.num_cached_prefix_blocks([b[2], *a]) == 0  # the match stops at the first miss
    assert alloc.allocate(2, 14, b) == 8
    assert alloc.blocks(2)[:2] == alloc.blocks(1)[:2]
    assert alloc.blocks(2)[2:] == [3, 4] and alloc.shared_prefix_blocks(2) == 2
    assert [alloc.ref_count(x) for x in range(5)] == [2, 2, 1, 1, 1]
    assert alloc.num_used_blocks == 5 and alloc.num_free_blocks == 3
    alloc.free(1)  # the shared blocks stay with request 2; block 2 becomes evictable
    assert [alloc.ref_count(x) for x in range(5)] == [1, 1, 0, 1, 1]
    assert alloc.num_evictable_blocks == 1 and alloc.num_cached_blocks == 3
    assert alloc.num_used_blocks == 4 and alloc.num_free_blocks == 4
    alloc.check_invariants()
    alloc.free(2)  # its own blocks were never hashed: they go back to plain free
    assert alloc.num_evictable_blocks == 3 and alloc.num_free_blocks == 8
    assert alloc.num_used_blocks == 0 and alloc.num_cached_prefix_blocks(a) == 3
    alloc.check_invariants()
    assert alloc.allocate(3, 12, a) == 12 and alloc.blocks(3) == [0, 1, 2]
    assert alloc.num_evictable_blocks == 0


def test_lru_eviction_order_and_only_when_space_is_needed():
    alloc = SlotAllocator(6, 2)
    a = cached_request(alloc, 1, [1, 2, 3, 4])  # blocks 0, 1
    b = cached_request(alloc, 2, [5, 6, 7, 8])  # blocks 2, 3
    alloc.free(1)
    alloc.free(2)
    assert alloc.num_evictable_blocks == 4
    alloc.allocate(3, 4)  # two plain free blocks are left: nothing is evicted
    assert alloc.blocks(3) == [4, 5] and alloc.num_cached_blocks == 4
    alloc.allocate(4, 1)  # request 1's tail block is the least recently used
    assert alloc.blocks(4) == [1]
    assert alloc.num_cached_prefix_blocks(a) == 1 and alloc.num_cached_prefix_blocks(b) == 2
    assert alloc.allocate(5, 4, b) == 4  # touching b's blocks takes them out of the LRU
    alloc.free(5)  # ... and puts them back as the most recent, tail first
    alloc.extend(4, 6)  # evicts block 0 (request 1's head), then block 3 (b's tail)
    assert alloc.blocks(4) == [1, 0, 3]
    assert alloc.num_cached_prefix_blocks(a) == 0 and alloc.num_cached_prefix_blocks(b) == 1
    assert alloc.num_cached_blocks == 1 and alloc.num_free_blocks == 1
    alloc.check_invariants()


def test_a_referenced_cached_block_is_never_evicted():
    alloc = SlotAllocator(3, 2)
    a = cached_request(alloc, 1, [1, 2, 3, 4])
    assert alloc.allocate(2, 4, a) == 4 and alloc.blocks(2) == alloc.blocks(1) == [0, 1]
    alloc.free(1)
    with pytest.raises(KVCacheFullError, match="needs 2 more blocks of 2 slots, 1 of 3 are free"):
        alloc.allocate(3, 4)
    assert alloc.ref_count(0) == alloc.ref_count(1) == 1 and alloc.num_cached_blocks == 2
    assert alloc.reset_prefix_cache() == 0 and alloc.num_cached_prefix_blocks(a) == 2
    alloc.free(2)
    alloc.allocate(3, 6)  # now both cached blocks are evicted for it
    assert sorted(alloc.blocks(3)) == [0, 1, 2] and alloc.num_cached_blocks == 0
    alloc.check_invariants()


def test_can_allocate_counts_cached_blocks():
    alloc = SlotAllocator(4, 2)
    a = cached_request(alloc, 1, [1, 2, 3, 4])
    assert not alloc.can_allocate(8) and alloc.can_allocate(8, a)
    assert alloc.num_blocks_to_allocate(8, a) == 2 and alloc.num_blocks_to_allocate(8) == 4
    assert not alloc.can_allocate(10, a)
    alloc.free(1)  # evictable blocks count as free, but reviving one takes it from the pool
    assert alloc.can_allocate(8) and alloc.can_allocate(8, a)
    assert alloc.num_blocks_to_allocate(8, a) == 4
    assert not alloc.can_allocate(3, a)  # hashes beyond num_tokens: allocate would refuse
    assert not alloc.can_allocate(-1)
    assert alloc.allocate(2, 8, a) == 4 and alloc.num_free_blocks == 0


def test_full_error_names_the_blocks_of_its_own_cached_prefix():
    alloc = SlotAllocator(4, 2)
    a = cached_request(alloc, 1, [1, 2, 3, 4])
    alloc.allocate(2, 2)
    alloc.free(1)
    with pytest.raises(KVCacheFullError, match="needs 2 more blocks of 2 slots, 1 of 4 are free "
                                               "besides the 2 evictable blocks of its cached"):
        alloc.allocate(3, 8, a)
    assert alloc.num_evictable_blocks == 2 and 3 not in alloc  # a failed allocate takes nothing
    alloc.check_invariants()


def test_the_same_prefix_computed_twice_keeps_one_cached_copy():
    alloc = SlotAllocator(8, 2)
    tokens = [1, 2, 3, 4, 5]
    hashes = alloc.block_hashes(tokens)
    alloc.allocate(1, 5)
    alloc.allocate(2, 5)
    assert alloc.cache_blocks(1, hashes) == 2 and alloc.cache_blocks(1, hashes) == 0
    assert alloc.cache_blocks(2, hashes) == 0  # request 2 keeps its own, unhashed copy
    assert alloc.shared_prefix_blocks(2) == 0 and alloc.num_cached_blocks == 2
    alloc.free(2)
    assert alloc.num_evictable_blocks == 0 and alloc.num_free_blocks == 5
    assert alloc.allocate(3, 5, hashes) == 4 and alloc.blocks(3)[:2] == alloc.blocks(1)[:2]
    alloc.check_invariants()


def test_reset_prefix_cache_drops_only_evictable_hashes():
    alloc = SlotAllocator(8, 2)
    a = cached_request(alloc, 1, [1, 2, 3, 4])
    b = cached_request(alloc, 2, [5, 6, 7, 8])
    alloc.free(1)
    assert alloc.reset_prefix_cache() == 2
    assert alloc.num_cached_prefix_blocks(a) == 0 and alloc.num_cached_prefix_blocks(b) == 2
    assert alloc.num_evictable_blocks == 0 and alloc.num_free_blocks == 6
    alloc.check_invariants()


def test_metadata_never_writes_a_cached_block():
    alloc = SlotAllocator(8, 4)
    a = cached_request(alloc, 1, list(range(8)))
    assert alloc.allocate(2, 12, a) == 8
    cu, ctx, table, slots, positions = alloc.build_metadata([2], [8], [4])
    assert min(slots.tolist()) >= 4 * alloc.blocks(2)[2]
    with pytest.raises(ValueError, match="request 2 would write position 7 into block 1, which "
                                         "holds cached"):
        alloc.build_metadata([2], [7], [2])
    alloc.build_metadata([2], [5], [0])  # no new tokens: nothing is written


def test_prefix_errors_are_clear():
    alloc = SlotAllocator(4, 2)
    a = alloc.block_hashes([1, 2, 3, 4])
    with pytest.raises(ValueError, match="request 1: 2 prefix_hashes cover 4 tokens, more than "
                                         r"num_tokens \(3\)"):
        alloc.allocate(1, 3, a)
    with pytest.raises(ValueError, match="num_tokens must be >= 0, got -1"):
        alloc.allocate(1, -1, a)
    with pytest.raises(ValueError, match=r"^2 prefix_hashes cover 4 tokens, more than num_tokens"):
        alloc.num_blocks_to_allocate(3, a)
    with pytest.raises(ValueError, match="num_tokens must be >= 0, got -2"):
        alloc.num_blocks_to_allocate(-2)
    alloc.allocate(1, 3)
    with pytest.raises(ValueError, match="request 1 holds 2 KV blocks, got 3 hashes"):
        alloc.cache_blocks(1, a + a[:1])
    with pytest.raises(UnknownRequestError, match="request 9 holds no KV blocks"):
        alloc.cache_blocks(9, a)
    with pytest.raises(UnknownRequestError, match="request 9 holds no KV blocks"):
        alloc.shared_prefix_blocks(9)
    alloc.cache_blocks(1, a[:1])
    with pytest.raises(ValueError, match="request 1: block 0 is cached under hash"):
        alloc.cache_blocks(1, a[::-1])
    assert alloc.num_cached_blocks == 1  # the failed call registered nothing
    for block in (-1, 4):
        with pytest.raises(ValueError, match=rf"block must be in \[0, 4\), got {block}"):
            alloc.ref_count(block)
    with pytest.raises(TypeError):
        alloc.cache_blocks(1, [-1])  # hashes are unsigned 64-bit
    alloc.check_invariants()


# Token sequences for the state machine: 1 shares its first two blocks with 0, 2 shares nothing.
BLOCK, POOL = 4, 8
SEQS = [list(range(24)), list(range(8)) + list(range(100, 116)), list(range(200, 224))]


class PrefixAllocatorMachine(RuleBasedStateMachine):
    """An exact Python model of the pool: who holds what, the hash map and the LRU order."""

    def __init__(self) -> None:
        super().__init__()
        self.alloc = SlotAllocator(POOL, BLOCK)
        self.reqs: dict[int, list[int]] = {}  # request -> its block list
        self.prompt_hashes: dict[int, list[int]] = {}  # request -> its prompt's block hashes
        self.computed: dict[int, int] = {}  # request -> tokens whose KV it has written
        self.prompt_len: dict[int, int] = {}
        self.cached: dict[int, int] = {}  # hash -> block
        self.block_hash: dict[int, int] = {}  # block -> hash
        self.lru: OrderedDict[int, None] = OrderedDict()  # evictable blocks, next victim first
        self.content: dict[int, int] = {}  # block -> hash of the full block's KV written there

    def refs(self) -> dict[int, int]:
        counts: dict[int, int] = {}
        for blocks in self.reqs.values():
            for b in blocks:
                counts[b] = counts.get(b, 0) + 1
        return counts

    def plain_free(self) -> int:
        return POOL - len(self.refs()) - len(self.lru)

    def take(self, new: list[int], plain_free: int) -> None:
        """Check the new blocks: ``plain_free`` free ones first, then LRU victims in order."""
        plain = min(len(new), plain_free)
        victims = list(self.lru)[:len(new) - plain]
        assert new[plain:] == victims
        held = self.refs()
        for b in new[:plain]:
            assert b not in self.lru and b not in self.block_hash and held[b] == 1
        for b in victims:
            del self.lru[b]
            del self.cached[self.block_hash.pop(b)]
        for b in new:
            self.content.pop(b, None)

    def _allocate(self, rid: int, seq: int, plen: int, extra: int, salt: int) -> bool:
        hashes = self.alloc.block_hashes(SEQS[seq][:plen], salt)
        # As a scheduler would: never reuse the block holding the last prompt token.
        prefix = hashes[:max(plen - 1, 0) // BLOCK]
        num_tokens = plen + extra
        found = 0
        while found < len(prefix) and prefix[found] in self.cached:
            found += 1
        reused = [self.cached[h] for h in prefix[:found]]
        revived = [b for b in reused if b in self.lru]
        fresh = -(-num_tokens // BLOCK) - found
        plain_free = self.plain_free()
        fits = fresh <= plain_free + len(self.lru) - len(revived)
        assert self.alloc.num_cached_prefix_blocks(prefix) == found
        assert self.alloc.num_blocks_to_allocate(num_tokens, prefix) == fresh + len(revived)
        assert self.alloc.can_allocate(num_tokens, prefix) == fits
        if rid in self.reqs:
            with pytest.raises(ValueError, match="already holds KV blocks"):
                self.alloc.allocate(rid, num_tokens, prefix)
            return False
        if not fits:
            with pytest.raises(KVCacheFullError):
                self.alloc.allocate(rid, num_tokens, prefix)
            return False
        assert self.alloc.allocate(rid, num_tokens, prefix) == found * BLOCK
        blocks = self.alloc.blocks(rid)
        assert blocks[:found] == reused
        for b, h in zip(reused, prefix):
            assert self.content[b] == h  # a reused block really holds that prefix's KV
            self.lru.pop(b, None)
        self.reqs[rid] = blocks
        self.take(blocks[found:], plain_free)
        self.prompt_hashes[rid] = hashes
        self.prompt_len[rid] = plen
        self.computed[rid] = found * BLOCK
        return True

    def _compute(self, rid: int, num_new: int) -> None:
        """Run the request's next tokens: the slots written must be its own, unhashed blocks."""
        start = self.computed[rid]
        num_new = min(num_new, self.alloc.capacity(rid) - start)
        if num_new <= 0:
            return
        slots = self.alloc.build_metadata([rid], [start], [num_new])[3].tolist()
        held = self.refs()
        for s in slots:
            b = s // BLOCK
            assert b in self.reqs[rid] and held[b] == 1 and b not in self.block_hash
        self.computed[rid] = start + num_new
        hashes = self.prompt_hashes[rid]
        for i in range(start // BLOCK, self.computed[rid] // BLOCK):
            if i < len(hashes):
                self.content[self.reqs[rid][i]] = hashes[i]

    def _cache(self, rid: int, num_hashes: int) -> None:
        hashes = self.prompt_hashes[rid][:num_hashes]
        new = 0
        for b, h in zip(self.reqs[rid], hashes):
            if b not in self.block_hash and h not in self.cached:
                self.cached[h] = b
                self.block_hash[b] = h
                new += 1
        assert self.alloc.cache_blocks(rid, hashes) == new

    def _computed_prompt_blocks(self, rid: int) -> int:
        return min(self.computed[rid], self.prompt_len[rid]) // BLOCK

    requests = dict(rid=st.integers(0, 4), seq=st.integers(0, 2),
                    plen=st.sampled_from([0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 24]),
                    extra=st.integers(0, 4), salt=st.sampled_from([0, 0, 0, 1]))

    @rule(**requests)
    def allocate(self, rid: int, seq: int, plen: int, extra: int, salt: int) -> None:
        self._allocate(rid, seq, plen, extra, salt)

    @rule(**requests, then_free=st.booleans())
    def prefill(self, rid: int, seq: int, plen: int, extra: int, salt: int,
                then_free: bool) -> None:
        """A whole prompt in one iteration, its full blocks cached, as the scheduler will do."""
        if self._allocate(rid, seq, plen, extra, salt):
            self._compute(rid, plen)
            self._cache(rid, self._computed_prompt_blocks(rid))
            if then_free:
                self._free(rid)

    @precondition(lambda self: self.reqs)
    @rule(data=st.data(), more=st.integers(0, 12))
    def extend(self, data: st.DataObject, more: int) -> None:
        rid = data.draw(st.sampled_from(sorted(self.reqs)))
        total = self.alloc.capacity(rid) + more
        fresh = -(-total // BLOCK) - len(self.reqs[rid])
        plain_free = self.plain_free()
        if fresh > plain_free + len(self.lru):
            with pytest.raises(KVCacheFullError):
                self.alloc.extend(rid, total)
            return
        self.alloc.extend(rid, total)
        blocks = self.alloc.blocks(rid)
        assert blocks[:len(self.reqs[rid])] == self.reqs[rid]
        self.reqs[rid] = blocks
        self.take(blocks[len(blocks) - fresh:], plain_free)

    @precondition(lambda self: self.reqs)
    @rule(data=st.data(), num_new=st.integers(1, 24))
    def compute(self, data: st.DataObject, num_new: int) -> None:
        self._compute(data.draw(st.sampled_from(sorted(self.reqs))), num_new)

    @precondition(lambda self: self.reqs)
    @rule(data=st.data())
    def cache(self, data: st.DataObject) -> None:
        rid = data.draw(st.sampled_from(sorted(self.reqs)))
        done = self._computed_prompt_blocks(rid)
        self._cache(rid, data.draw(st.sampled_from([done, done, done // 2])))

    def _free(self, rid: int) -> None:
        self.alloc.free(rid)
        blocks = self.reqs.pop(rid)
        held = self.refs()
        for b in reversed(blocks):
            if b not in held and b in self.block_hash:
                self.lru[b] = None

    @precondition(lambda self: self.reqs)
    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        self._free(data.draw(st.sampled_from(sorted(self.reqs))))

    @rule(rid=st.integers(5, 6))
    def free_unknown(self, rid: int) -> None:
        with pytest.raises(UnknownRequestError):
            self.alloc.free(rid)

    @rule()
    def reset(self) -> None:
        assert self.alloc.reset_prefix_cache() == len(self.lru)
        for b in self.lru:
            del self.cached[self.block_hash.pop(b)]
        self.lru.clear()

    @invariant()
    def matches_the_model(self) -> None:
        self.alloc.check_invariants()
        held = self.refs()
        for b in range(POOL):
            assert self.alloc.ref_count(b) == held.get(b, 0)
            if held.get(b, 0) > 1:
                assert b in self.block_hash  # only cached full blocks are shared
        assert self.alloc.num_used_blocks == len(held)
        assert self.alloc.num_free_blocks == POOL - len(held)
        assert self.alloc.num_evictable_blocks == len(self.lru)
        assert self.alloc.num_cached_blocks == len(self.cached)
        for h, b in self.cached.items():
            assert self.alloc.num_cached_prefix_blocks([h]) == 1
            assert b in held or b in self.lru
        for rid, blocks in self.reqs.items():
            shared = 0
            while shared < len(blocks) and blocks[shared] in self.block_hash:
                shared += 1
            assert self.alloc.shared_prefix_blocks(rid) == shared

    def teardown(self) -> None:
        for rid in list(self.reqs):
            self.alloc.free(rid)
        assert self.alloc.num_free_blocks == POOL and self.alloc.num_used_blocks == 0
        assert all(self.alloc.ref_count(b) == 0 for b in range(POOL))
        self.alloc.check_invariants()


PrefixAllocatorMachine.TestCase.settings = settings(max_examples=200, stateful_step_count=40,
                                                    deadline=None)
test_prefix_allocator_state_machine = PrefixAllocatorMachine.TestCase
