"""Memory that every rank of a process group can read, for exchanges that copy straight out of a peer's memory.

Each rank keeps two slots, opened in every other rank of the group (CUDA IPC between the GPUs of one host, each
opened in the reading GPU's own context (:mod:`mmsparse.runtime.ipc_memory`), or a shared-memory file between CPU
processes of one host). An exchange writes what the peers need into this rank's slot, meets them at a barrier,
and each rank then copies what it needs out of the peers' slots: on GPUs by copy engines, one stream per peer, no
SMs. The slots take turns: an exchange writes the slot the one before it did not use. A slot is written again two
exchanges later, after a barrier that each rank reaches only once its own copies of the earlier exchange are done
(the caller's stream waits for them before that barrier), so no rank overwrites what a peer is still reading.

Every rank of the group must take part in the same exchanges in the same order, as with NCCL's point to point.
The slots stay until :func:`release_peer_memory` (a collective) or the process's end: the map of memories holds
each group weakly, but a slot opened in the peers can only be freed once they have closed it.
"""

from __future__ import annotations

import os
import socket
import tempfile
import threading
import uuid
import weakref
from typing import Any

import torch
import torch.distributed as dist

from ..runtime.cuda_driver import CudaDriverError, copy_rows_on_stream, driver, write_value_on_stream
from ..runtime.ipc_memory import SharedBlock, close_block, open_block
from ..runtime.streams import own_stream

MAX_PITCH = 2**31 - 1  # bytes between the rows of a 2-D copy, at most (CU_DEVICE_ATTRIBUTE_MAX_PITCH)
_SLOT_ALIGN = 1 << 20  # slots grow in whole MiB, so a little more next time does not reopen them
_MEMORIES: dict[tuple[int, torch.device], PeerMemory] = {}
_MEMORIES_LOCK = threading.Lock()


def peer_memory(group: Any, device: torch.device) -> PeerMemory:
    """The group's :class:`PeerMemory` on this device, made (a collective: every rank must ask) at its first use."""
    key = (id(group), device)
    memory = _MEMORIES.get(key)
    if memory is None or memory.group is not group:  # a group's id may name a new group once the old one is gone
        with _MEMORIES_LOCK:
            memory = _MEMORIES.get(key)
            if memory is None or memory.group is not group:  # another thread may have made it meanwhile
                memory = _MEMORIES[key] = PeerMemory(group, device)
    return memory


def release_peer_memory(group: Any = None) -> None:
    """Free this process's peer-copy slots of ``group`` (a ``ProcessGroup``, a 1-D ``DeviceMesh``, or None for the
    default group) and close its views of the peers' slots, on every device it used them on. A collective: every
    rank of the group calls it, after its last context-parallel call on the group and before
    ``dist.destroy_process_group(group)`` (a slot the peers have opened cannot be freed without them). A later
    peer-copy exchange on the group makes new slots."""
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("release_peer_memory needs torch.distributed initialised (init_process_group): it is a "
                           "collective over the group's ranks")
    get_group = getattr(group, "get_group", None)  # a DeviceMesh
    group = dist.group.WORLD if group is None else get_group() if get_group is not None else group
    if not isinstance(group, dist.ProcessGroup):
        raise TypeError(f"release_peer_memory takes a ProcessGroup, a 1-D DeviceMesh or None (the default group); "
                        f"got {type(group).__name__}")
    with _MEMORIES_LOCK:
        mine = sorted(((key, m) for key, m in _MEMORIES.items() if m.group is group), key=lambda km: str(km[0][1]))
        for key, _ in mine:
            del _MEMORIES[key]
    for _, memory in mine:  # in device order: the same on every rank of a group of one device each
        memory.release()


class PeerMemory:
    """Two slots of this rank's memory that the group's other ranks have opened, and theirs opened here.

    ``reason`` is None where the group can use it, else why not (every rank gets the same answer): ranks on
    more than one host, GPUs that cannot reach each other, a backend other than NCCL on GPUs or gloo on CPUs."""

    def __init__(self, group: Any, device: torch.device) -> None:
        self._group, self.device = weakref.ref(group), device
        self.rank, self.world_size = dist.get_rank(group), dist.get_world_size(group)
        self.reason = _why_not_usable(group, device)
        self.capacity = 0  # bytes of each slot
        self._mine: list[Any] = []  # per slot: a SharedBlock (GPU) or a file-backed tensor (CPU)
        self._theirs: list[list[Any]] = []  # per slot, per rank: an address (GPU) or a tensor (CPU); None: this rank
        self._turn = self._current = 0
        self._token = torch.zeros(1, dtype=torch.int32, device=device)
        self._streams: dict[int, torch.cuda.Stream] = {}
        self._pulling: list[torch.cuda.Stream] = []
        # Arrival flags (signal_arrival): the int32 flag, the stream that writes it, the last epoch written, and
        # why the driver cannot write it (None: not tried, or it can)
        self._flag: torch.Tensor | None = None
        self._flag_stream: torch.cuda.Stream | None = None
        self._epoch = 0
        self._no_flags: str | None = None

    @property
    def group(self) -> Any:
        """The process group (None once it is gone)."""
        return self._group()

    def release(self) -> None:
        """Close this rank's views of the peers' slots and free its own, every rank at once (a collective); the
        next :meth:`reserve` makes new ones. Slots kept from before a failed growth go too (every rank holds the
        same capacity)."""
        if self.capacity > 0:
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)  # this rank's copies out of the peers' slots are done
            self._replace(0, [], [[None] * self.world_size for _ in range(2)])

    def reserve(self, nbytes: int) -> None:
        """Slots of at least ``nbytes`` (every rank asks for the same): they grow, all ranks at once, where they
        are smaller. Where a rank cannot make or open them, ``reason`` says so on every rank and nothing is kept."""
        if self.reason is None and nbytes > self.capacity:
            self._grow(-(-nbytes // _SLOT_ALIGN) * _SLOT_ALIGN)

    def slot(self) -> torch.Tensor:
        """This rank's next slot, as uint8, to write this exchange's messages in (:meth:`reserve` first); the
        peers' slots of the same turn are what :meth:`pull` reads."""
        if self.reason is not None:
            raise RuntimeError(f"peer memory cannot be used on this group: {self.reason}")
        self._current = self._turn % 2
        self._turn += 1
        mine = self._mine[self._current]
        return mine.tensor if self.device.type == "cuda" else mine

    def barrier(self) -> None:
        """Every rank's writes so far (in its current stream's order) are done before this rank's current stream
        goes on: an all-reduce of one integer."""
        dist.all_reduce(self._token, group=self.group)

    def pull(self, peer: int, src_offset: int, src_pitch: int, dst: torch.Tensor, dst_start: int,
             count: int) -> None:
        """Copy ``count`` tokens into each row of ``dst`` from ``dst_start`` on, out of ``peer``'s slot of this turn:
        row r's from byte ``src_offset + r * src_pitch``. ``dst``: a ``[rows, tokens, width]`` view whose tokens and
        width are contiguous (rows any uniform stride). On the GPU one 2-D copy on a stream of the peer's own, after
        the work queued so far on the current stream, until :meth:`wait`."""
        rows, _, width = dst.shape
        size = dst.element_size()
        if dst.stride(2) != 1 or dst.stride(1) != width:
            raise ValueError("a pull writes rows of contiguous tokens")
        if src_offset + (rows - 1) * src_pitch + count * width * size > self.capacity:
            raise ValueError(f"a pull reads past the peer's slot of {self.capacity} bytes")
        source = self._theirs[self._current][peer]
        if self.device.type != "cuda":
            tokens = source.view(dst.dtype).as_strided((rows, count, width), (src_pitch // size, width, 1),
                                                       src_offset // size)
            dst[:, dst_start : dst_start + count].copy_(tokens)
            return
        if max(src_pitch, dst.stride(0) * size) > MAX_PITCH:
            raise ValueError(f"rows {max(src_pitch, dst.stride(0) * size)} bytes apart are past a 2-D copy's "
                             f"{MAX_PITCH}: use transport='p2p' for this size")
        stream = self._streams.get(peer)
        if stream is None:
            stream = self._streams[peer] = own_stream(self.device.index)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        copy_rows_on_stream(dst.data_ptr() + dst_start * width * size, dst.stride(0) * size, source + src_offset,
                            src_pitch, count * width * size, rows, stream.cuda_stream, self.device.index)
        dst.record_stream(stream)  # its memory stays this stream's until the copy is done
        self._pulling.append(stream)

    def signal_arrival(self) -> tuple[torch.Tensor, int] | None:
        """After this exchange's pulls: ``(flag, epoch)``, an int32 flag on this rank's GPU that a stream memory
        operation sets to ``epoch`` once every :meth:`pull` since the last :meth:`wait` has landed, with no kernel
        (so a kernel that spins on it while holding every SM cannot keep it from being set). Epochs grow, and the
        flag is written by one stream in their order, so it never goes back. None off the GPU or where the driver
        cannot write it (then :meth:`wait` is the only way to wait for the pulls)."""
        if self.device.type != "cuda" or self._no_flags is not None:
            return None
        if self._flag is None:
            self._flag = torch.zeros(1, dtype=torch.int32, device=self.device)
            self._flag_stream = own_stream(self.device.index)
        for stream in self._pulling:
            self._flag_stream.wait_stream(stream)
        try:
            write_value_on_stream(self._flag.data_ptr(), self._epoch + 1, self._flag_stream.cuda_stream,
                                  self.device.index)
        except CudaDriverError as error:
            self._no_flags = str(error)
            return None
        self._epoch += 1
        return self._flag, self._epoch

    def wait(self) -> None:
        """The current stream waits for every :meth:`pull` since the last wait."""
        if self.device.type == "cuda":
            current = torch.cuda.current_stream(self.device)
            for stream in self._pulling:
                current.wait_stream(stream)
        self._pulling.clear()

    def _grow(self, capacity: int) -> None:
        # No rank may still read the old slots when they go: each rank's device is idle before the handles'
        # all-gather, which no rank leaves before every rank has entered it; then every rank closes its view of
        # the peers' old slots before any rank frees its own.
        cuda = self.device.type == "cuda"
        if cuda:
            torch.cuda.synchronize(self.device)
        mine: list[Any] = []
        shared: list[Any] = []
        made = _attempt(lambda: self._make(capacity, mine, shared))
        handles: list[Any] = [None] * self.world_size
        dist.all_gather_object(handles, (shared, made), group=self.group)
        theirs: list[list[Any]] = [[None] * self.world_size for _ in range(2)]
        failed = next((error for _, error in handles if error is not None), None)
        if failed is None:
            failed = _attempt(lambda: self._open_all(handles, capacity, theirs))
            verdicts: list[Any] = [None] * self.world_size
            dist.all_gather_object(verdicts, failed, group=self.group)
            failed = next((error for error in verdicts if error is not None), None)
        if not cuda:
            for path in shared:
                os.unlink(path)  # every rank has mapped the files, or given up on them: their names can go
        if failed is None:
            self._replace(capacity, mine, theirs)
        else:
            self._drop(theirs, mine)
            self.reason = f"a rank could not make or open the shared slots: {failed}"

    def _replace(self, capacity: int, mine: list[Any], theirs: list[list[Any]]) -> None:
        """Take ``mine`` and ``theirs`` as the slots (every rank at once), dropping the ones before: the caller has
        made its device idle, so that once every rank meets the others no rank reads them any more."""
        self._drop(self._theirs, self._mine)
        self._mine, self._theirs, self.capacity = mine, theirs, capacity

    def _drop(self, theirs: list[list[Any]], mine: list[Any]) -> None:
        """Close the views ``theirs`` of the peers' slots, then, once every rank has closed its own, free ``mine``
        (a collective)."""
        cuda = self.device.type == "cuda"
        for row in theirs:
            for view in row:
                if cuda and view is not None:
                    close_block(view, self.device)
        dist.barrier(group=self.group)  # every rank has closed what it no longer reads
        if cuda:
            for block in mine:
                block.free()

    def _make(self, capacity: int, mine: list[Any], shared: list[Any]) -> None:
        for _ in range(2):
            if self.device.type == "cuda":
                mine.append(SharedBlock(self.device, capacity))
                shared.append(mine[-1].handle)
            else:
                shared.append(_shared_file())
                mine.append(torch.from_file(shared[-1], shared=True, size=capacity, dtype=torch.uint8))

    def _open_all(self, handles: list[Any], capacity: int, theirs: list[list[Any]]) -> None:
        for r, (slots, _) in enumerate(handles):
            if r != self.rank:
                for i in range(2):
                    theirs[i][r] = self._open(slots[i], capacity)

    def _open(self, handle: Any, capacity: int) -> Any:
        if self.device.type == "cuda":
            return open_block(handle, self.device)
        return torch.from_file(handle, shared=True, size=capacity, dtype=torch.uint8)


def _attempt(step: Any) -> str | None:
    """None where ``step()`` ran, else what went wrong (the slots are then not used, on any rank)."""
    try:
        step()
    except (CudaDriverError, RuntimeError, OSError) as error:
        return f"{type(error).__name__}: {error}"
    return None


def _shared_file() -> str:
    """A new file for a CPU slot, in shared memory where the host has it."""
    folder = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
    return os.path.join(folder, f"mmsparse-peer-{os.getpid()}-{uuid.uuid4().hex}")


def _why_not_usable(group: Any, device: torch.device) -> str | None:
    """None where every rank can read every other rank's memory, else why not; the same answer on every rank (a
    collective)."""
    backend = dist.get_backend(group)
    facts = (socket.gethostname(), device.type, backend, _device_uuid(device), device.index)
    everyone: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, facts, group=group)
    if len({f[0] for f in everyone}) > 1:
        return "its ranks run on more than one host"
    if len({f[1] for f in everyone}) > 1:
        return "its ranks hold tensors on different kinds of device"
    wanted = "nccl" if device.type == "cuda" else "gloo"
    if backend != wanted:
        return f"its backend is {backend}; peer copies on {device.type} need {wanted}"
    problem = _cannot_reach(device, everyone) if device.type == "cuda" else None
    if device.type == "cuda" and problem is None and driver() is None:
        problem = "the CUDA driver library (libcuda) could not be loaded"
    problems: list[Any] = [None] * len(everyone)
    dist.all_gather_object(problems, problem, group=group)
    return next((p for p in problems if p is not None), None)


def _device_uuid(device: torch.device) -> str | None:
    if device.type != "cuda":
        return None
    value = getattr(torch.cuda.get_device_properties(device), "uuid", None)
    return None if value is None else str(value)


def _cannot_reach(device: torch.device, everyone: list[Any]) -> str | None:
    """Why this rank cannot open and read each peer's GPU memory, or None: a peer's device index must name the same
    GPU here (IPC opens a handle on that index), and this GPU must reach it."""
    for _, _, _, peer_uuid, index in everyone:
        if index == device.index:
            continue
        if peer_uuid is None or index >= torch.cuda.device_count() or _device_uuid(torch.device("cuda", index)) != (
                peer_uuid):
            return f"a peer's GPU (cuda:{index}) is not the same device in every process (CUDA_VISIBLE_DEVICES)"
        if not torch.cuda.can_device_access_peer(device.index, index):
            return f"cuda:{device.index} cannot access cuda:{index} directly"
    return None
