"""The control block: int64 counters in shared host memory that the publisher
and its subscribers read and write with sequentially consistent atomics.
"""

import time
from typing import Callable

import torch

from .. import _C, _process

# Note [weights consistency protocol]
# A subscriber must never copy a version the publisher is overwriting, and the
# publisher must not block on the GPU work of its subscribers. The block has:
#   PUBLISHED  the newest complete version (0: none yet)
#   WRITING    1 while publish() writes the shared buffer
#   PUBLISHER  the publisher's process word (Note [process words]); 0 once closed
#   per subscriber slot r: OWNER (its process word; -1 reserved, 0 free), READING (1 while it reads), PULLS,
#   TAKEN (bucketed mode); and, outside the block, DONE_EVENT[r]: an IpcEvent
#   the subscriber records after its copies (one per staging half, bucketed)
# Direct mode, one snapshot buffer:
#   subscriber: READING[r] = 1; if WRITING: READING[r] = 0, back off, retry;
#     v = PUBLISHED; its stream waits on the publish event; queue the copies;
#     record DONE_EVENT[r]; READING[r] = 0.
#   publisher: WRITING = 1; for each slot: spin while READING[r] (only the
#     host-side queueing of a pull, or an open view()), then its stream waits
#     on DONE_EVENT[r]; queue the snapshot copy; record the publish event;
#     PUBLISHED = v + 1; WRITING = 0.
# A streaming relay (Note [pulling a relayed version as it lands] in relay.py)
# sets WRITING = STREAMING inside its window, once STREAM_VERSION and
# BUCKET_SEQ are stored: a pull may then read the pieces BUCKET_SEQ counts.
# Each side stores its flag and then loads the other's, seq_cst (Dekker), so
# at least one of them sees the other: a pull either finishes queueing before
# the publisher writes (and the GPU orders the write after the copy through
# DONE_EVENT) or sees WRITING and retries. The host never waits for the GPU;
# the only host wait is the publisher's on a subscriber queueing, microseconds.
# Bucketed mode streams version v through two staging halves; bucket k of the
# stream has a global sequence number seq and lives in half seq % 2. The
# publisher fills seq only after every member took seq - 2 (TAKEN[r] >= seq-2,
# then its stream waits on that half's DONE_EVENT[r]); members are the slots
# claimed when the version starts (MEMBERS bitmask, published with
# STREAM_BASE before the first bucket). publish() returns when every member
# took the last bucket.

# Note [two control blocks]
# The KV pool's block table (csrc/features/kv/) is C++ under a robust mutex,
# one call per operation; this block is int64 words that Python reads and
# writes with one seq_cst atomic per call (_C.counter_*). Two mechanisms, on
# purpose:
# - What they guard. The block table changes many words together (the free
#   list, each block's holder, each process's count): it needs mutual
#   exclusion, and a holder killed inside an update needs the rebuild that a
#   robust mutex's EOWNERDEAD allows. Here each word has one writer (the
#   publisher: PUBLISHED, WRITING, BUCKET_SEQ, STREAM_*, MEMBERS; a slot's
#   subscriber: READING, PULLS, TAKEN; OWNER: one compare-exchange to claim,
#   one to give back), so there is no invariant across words to lock, and a
#   process killed anywhere leaves at most its own READING = 1, cleared when
#   the publisher reaps its slot. No lock: nothing to recover, and no process
#   descheduled inside a critical section that stalls the trainer; the
#   publisher waits only on a subscriber that is queueing its copies.
# - What it costs. On the 2-core CPU machine, busy (load 12), with
#   benchmarks/control_block_bench.py, medians of two runs: one counter call
#   0.36-0.73 us; a direct pull's whole handshake (6 calls) 2.3-3.4 us of the
#   12.7-14.8 us that a pull of one small tensor takes end to end; publish()'s
#   with one subscriber (5 calls) 2.0-2.5 us; a KV allocate + free (2 calls,
#   each under the mutex) 2.6 us. One C++ call per protocol step would save
#   1.5-3 us a pull; a GPU pull also launches copies (tens of us). So the protocol
#   stays in Python, in one place, next to the events it orders. Should the
#   calls show in a profile, fold each step into one C++ call on these same
#   words, not into the KV table's mutex.

# Note [process words]
# OWNER and PUBLISHER name a process by its life key (Note [life files] in
# csrc/os/life.h): the publisher and a subscriber may live in different PID
# namespaces (containers sharing /dev/shm), where the other's pid names
# nothing or an unrelated process, while a life file's lock tells the same
# in every namespace: held, it lives; free or gone, it died; not readable,
# it counts as alive. A process exits or execs and its lock goes, so a dead
# subscriber never keeps its slot; a key is taken again only once its file is
# gone and then at random among 2**31, so a dead publisher practically never
# passes for alive (and at worst looks alive, never dead while it lives).
# Claiming a slot must stay one compare-exchange, so the word is one int64:
# the pid (in its own namespace, for messages only) in the low 22 bits (Linux
# pids stay below PID_MAX_LIMIT, 2**22) and the life key (31 bits) above; the
# word is positive, leaving 0 and -1 for "free" and "reserved". A check costs
# ~1 us (a cached fd: fstat and F_OFD_GETLK), made when a slot is looked for,
# every ~10 ms of a wait, and when an event is not complete yet. Layout
# version 2 put the start time where the key is: refused (Counters).
_PID_BITS = 22
_KEY_BITS = 31

MAGIC_VALUE = 0x7765_6967_6874_7303  # "weights" and layout version 3
_MAGIC_OF_VERSION_2 = 0x7765_6967_6874_7302
MAGIC, PUBLISHED, WRITING, BUCKET_SEQ, STREAM_BASE, STREAM_VERSION, MEMBERS, PUBLISHER = range(8)
HEADER = 8
STREAMING = 2  # WRITING's value while a relay's version lands piece by piece (relay.py)
OWNER, READING, PULLS, TAKEN = range(4)
SLOT_WORDS = 4
MAX_SUBSCRIBERS = 62  # MEMBERS is a bitmask in one int64


def new_block(max_subscribers: int) -> torch.Tensor:
    if not 1 <= max_subscribers <= MAX_SUBSCRIBERS:
        raise ValueError(f"max_subscribers must be in 1..{MAX_SUBSCRIBERS}, not {max_subscribers}")
    # torch_ipc moves it into shared memory (in place) at the first attach
    block = torch.zeros(HEADER + SLOT_WORDS * max_subscribers, dtype=torch.int64)
    block[PUBLISHER] = self_word()
    block[MAGIC] = MAGIC_VALUE
    return block


def slots(block: torch.Tensor) -> int:
    return (block.numel() - HEADER) // SLOT_WORDS


def slot_index(r: int, field: int) -> int:
    return HEADER + SLOT_WORDS * r + field


class Counters:
    """Atomic access to one control block."""

    __slots__ = ("block",)

    def __init__(self, block: torch.Tensor):
        if block.dtype != torch.int64 or block.numel() < HEADER + SLOT_WORDS:
            raise ValueError("torch_ipc.weights: not a weights control block")
        if int(block[MAGIC]) == _MAGIC_OF_VERSION_2:
            raise ValueError("torch_ipc.weights: the publisher runs another torch_ipc version (control block "
                             "layout 2, this one reads 3); use one torch_ipc version on both sides")
        if int(block[MAGIC]) != MAGIC_VALUE:
            raise ValueError("torch_ipc.weights: not a weights control block")
        self.block = block

    def load(self, index: int) -> int:
        return _C.counter_load(self.block, index)

    def store(self, index: int, value: int) -> None:
        _C.counter_store(self.block, index, value)

    def compare_exchange(self, index: int, expected: int, desired: int) -> int:
        return _C.counter_compare_exchange(self.block, index, expected, desired)


def self_word() -> int:
    """This process as an OWNER or PUBLISHER word (Note [process words])."""
    pid, _, key, _ = _process.self_identity()
    if key == 0:
        raise OSError(_C.life_file_error(), "torch_ipc.weights: cannot create this process's life file in "
                      "/dev/shm: a control word names a process by it (Note [process words])")
    if pid >> _PID_BITS or key >> _KEY_BITS:
        raise RuntimeError(f"torch_ipc.weights: process ({pid}, key {key}) does not fit a control word")
    return key << _PID_BITS | pid


def word_pid(word: int) -> int:
    return word & ((1 << _PID_BITS) - 1)


def word_alive(word: int) -> bool:
    """Whether the process of a word (0, -1: none) still runs; one that could
    not be checked counts as alive (Note [process words])."""
    return word > 0 and _C.life_key_alive((word >> _PID_BITS) & ((1 << _KEY_BITS) - 1))


def spin_until(ready: Callable[[], bool], check: Callable[[], None], deadline: float,
               max_sleep: float = 1e-3) -> None:
    """Wait for `ready()`, spinning first then sleeping up to `max_sleep`;
    `check()` runs every ~10 ms (it raises when the other side died);
    TimeoutError after `deadline` (time.monotonic())."""
    delay, checked = 0.0, time.monotonic()
    while not ready():
        now = time.monotonic()
        if now - checked > 0.01:
            check()
            checked = now
        if now > deadline:
            check()
            raise TimeoutError("torch_ipc.weights: timed out waiting for the other side")
        if delay:
            time.sleep(delay)
        delay = min(max(delay * 2, 2e-5), max_sleep)
