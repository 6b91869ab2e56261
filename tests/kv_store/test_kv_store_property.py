"""Property: whatever happens to the files, the store never returns bytes other than those put."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from prefixserve.kv_store.block_write import BlockWrite
from tests.helpers.kv_store import FakeClock, key, open_store, payload, record_files, tokens

KEYS = st.integers(0, 3)
GROUPS = st.integers(0, 1)
VARIANTS = st.integers(0, 1)  # two token-id lists per hash: a collision
CAPACITY = 12_000


class StoreMachine(RuleBasedStateMachine):
    """Puts, gets, evictions, reopenings, expiry and every kind of damage to the files. The model
    holds, per key, the last put (token variant, payload, expiry) and whether its file may still
    be good; a get returns that payload or None, and None whenever the file cannot be good."""

    def __init__(self):
        super().__init__()
        self.root = Path(tempfile.mkdtemp(prefix="kvstore-prop-"))
        self.clock = FakeClock()
        self.store = open_store(self.root, capacity=CAPACITY, clock=self.clock)
        self.model: dict[tuple[bytes, int], tuple[int, bytes, float | None]] = {}
        self.damaged: set[tuple[bytes, int]] = set()
        # A damaged key's file as it was before its first damage.
        self.intact: dict[tuple[bytes, int], bytes] = {}
        # A key's file after its latest put (None: the put evicted it at once), and after each
        # earlier one.
        self.latest: dict[tuple[bytes, int], bytes | None] = {}
        self.earlier: dict[tuple[bytes, int], set[bytes]] = {}

    def teardown(self):
        shutil.rmtree(self.root, ignore_errors=True)

    def _expected(self, k, variant):
        if k not in self.model or k in self.damaged:
            return None
        stored_variant, data, expires_at = self.model[k]
        if stored_variant != variant or (expires_at is not None and expires_at <= self.clock.now):
            return None
        return data

    @rule(
        i=KEYS,
        group=GROUPS,
        variant=VARIANTS,
        size=st.integers(0, 3000),
        ttl=st.none() | st.integers(1, 5),
    )
    def put(self, i, group, variant, size, ttl):
        k = key(i, group)
        expires_at = None if ttl is None else self.clock.now + ttl
        data = payload(i, size, variant, group) + bytes([size % 251])
        if self.store.put(BlockWrite.at(k, tokens(i, variant), data, expires_at)):
            self.model[k] = (variant, data, expires_at)
            self.damaged.discard(k)
            if self.latest.get(k) is not None:
                self.earlier.setdefault(k, set()).add(self.latest[k])
            written = Path(self.store.path(k))  # (a put past the capacity may evict it at once)
            self.latest[k] = written.read_bytes() if written.exists() else None

    @rule(i=KEYS, group=GROUPS, variant=VARIANTS, into=st.booleans())
    def get(self, i, group, variant, into):
        k = key(i, group)
        expected = self._expected(k, variant)
        if into:
            size = len(expected) if expected is not None else len(self.model.get(k, (0, b""))[1])
            out = bytearray(size)
            got = bytes(out) if self.store.get_into(k, tokens(i, variant), out) else None
        else:
            got = self.store.get(k, tokens(i, variant))
        assert got is None or got == expected, "returned bytes that were not put for this key"
        if expected is None:
            assert got is None
        if got is None:  # whatever was there is gone or was never there
            self.model.pop(k, None)
            self.damaged.discard(k)

    def _read_damaged(self, k, into):
        """A damaged file is never a hit; the read removes it."""
        i = next(i for i in range(4) if key(i, k[1]) == k)
        variant, data, _ = self.model.pop(k)
        self.damaged.discard(k)
        if into:
            assert not self.store.get_into(k, tokens(i, variant), bytearray(len(data)))
        else:
            assert self.store.get(k, tokens(i, variant)) is None
        assert not os.path.exists(self.store.path(k))

    @precondition(lambda self: self.damaged)
    @rule(data=st.data(), into=st.booleans())
    def get_a_damaged_block(self, data, into):
        self._read_damaged(data.draw(st.sampled_from(sorted(self.damaged))), into)

    @rule(target_fraction=st.floats(0, 1))
    def evict(self, target_fraction):
        self.store.evict(int(CAPACITY * target_fraction))

    @rule(seconds=st.integers(1, 6))
    def advance_clock(self, seconds):
        self.clock.advance(seconds)

    @rule()
    def sweep(self):
        self.store.sweep_expired()

    @rule()
    def reopen(self):
        self.store = open_store(self.root, capacity=CAPACITY, clock=self.clock)

    def _files(self):
        return record_files(self.root)

    @precondition(lambda self: record_files(self.root))
    @rule(
        data=st.data(),
        how=st.sampled_from(["flip", "truncate", "append", "swap", "zero"]),
        read_now=st.booleans(),
    )
    def damage(self, data, how, read_now):
        files = self._files()
        path = data.draw(st.sampled_from(files))
        k = next((k for k in self.model if self.store.path(k) == str(path)), None)
        raw = bytearray(path.read_bytes())
        if not raw and how in ("flip", "truncate"):  # already truncated to nothing
            how = "append"
        if how == "flip":
            raw[data.draw(st.integers(0, len(raw) - 1))] ^= 1 << data.draw(st.integers(0, 7))
        elif how == "truncate":
            raw = raw[: data.draw(st.integers(0, len(raw) - 1))]
        elif how == "append":
            raw += b"\0"
        elif how == "zero":
            raw = bytearray(len(raw))
        else:
            other = data.draw(st.sampled_from(files))
            if other == path:
                return
            raw = bytearray(other.read_bytes())
        if raw == path.read_bytes():
            # Not damage: the other file already held a copy of this one (an earlier swap the
            # other way), so this block's record is back in its own file, intact.
            return
        if (
            k is not None
            and bytes(raw) in self.earlier.get(k, ())
            and bytes(raw) != self.latest.get(k)
        ):
            # Nor an earlier put's record of this very key (a swap back after a newer put):
            # authentic bytes put for this key and tokens, which no store can tell from the
            # newest; the property is about bytes never put for the key. (The latest put's
            # record coming back is the undoing below.)
            return
        if k is not None and k not in self.damaged:
            self.intact[k] = path.read_bytes()
        stat = path.stat()
        path.write_bytes(raw)
        os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))  # hide it from a stat
        if k is not None:
            if raw == self.intact.get(k):
                # A second damage undid the first (the same bit flipped twice): intact again.
                self.damaged.discard(k)
                return
            self.damaged.add(k)
            if read_now:
                self._read_damaged(k, data.draw(st.booleans()))

    @invariant()
    def no_temp_files_left(self):
        assert not list(self.root.rglob(".*.tmp"))


StoreMachine.TestCase.settings = settings(
    max_examples=100,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
test_the_store_never_returns_bytes_other_than_those_put_for_the_key = StoreMachine.TestCase
