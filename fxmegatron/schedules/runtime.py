"""Execute one pipeline rank's actions: chunks forward and backward, P2P between stages.

* Consecutive send/recv actions are posted together with ``batch_isend_irecv``;
  a receive is waited on when a compute needs it, sends at the end of the step.
* Each message has its own tag (direction, boundary, microbatch, tensor), so
  gloo never pairs a send with the wrong receive.
* Waits poll, and a rank that fails writes its error into the process group's
  store: the other ranks see it while they wait and raise ``PipelineError``
  naming the failed rank, instead of hanging in a receive that never completes.
* Loss: microbatch i's loss is scaled by ``weights[i]`` before its backward, so
  that the sum over microbatches is the whole batch's loss (for a mean loss
  over equal microbatches, weights are 1/m).
* Evaluation (``run_forward``) runs the forward-only schedule of the training one
  under ``no_grad`` and keeps nothing for a backward: a boundary tensor is dropped as
  soon as the next chunk or its send has taken it.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch import Tensor

from fxmegatron.errors import PipelineError
from fxmegatron.schedules.actions import Action, Schedule
from fxmegatron.schedules.generate import forward_only

ERROR_KEY = "fxmegatron/pipeline_error"



@dataclass(frozen=True)
class TensorSpec:
    shape: Tuple[int, ...]
    dtype: torch.dtype
    grad: bool          # a gradient flows back across the boundary for this tensor
    # the shape with dropout off (module.eval()), where it differs: the dropout key carries a
    # third word then, and a receive buffer of the training shape would not match the send
    eval_shape: Optional[Tuple[int, ...]] = None

    def recv_shape(self, dropout_off: bool) -> Tuple[int, ...]:
        return self.eval_shape if dropout_off and self.eval_shape is not None else self.shape


def add_weighted(total: Optional[Tensor], loss: Tensor, w: float) -> Tensor:
    """``total + loss·w``, detached: the step's loss so far. A microbatch of weight 0 has no
    counted label, so its mean loss is 0/0 = NaN and NaN·0 would make the step's loss NaN;
    it adds 0, as it adds to the unmodified model's mean over the batch's counted tokens."""
    part = loss.detach() * w if w != 0 else torch.zeros_like(loss.detach())
    return part if total is None else total + part


def _store():
    try:
        return dist.distributed_c10d._get_default_store()
    except Exception:   # not initialised, or a backend without a store
        return None


def error_key(peers: Sequence[int]) -> str:
    """The store key where this pipeline's ranks report failures. Each runner built over
    ``peers`` gets its own key (a counter in the store, bumped once by every peer, numbers
    the runners), so a failure of an earlier pipeline in the same job, reported and caught,
    does not fail the next one."""
    store = _store()
    name = "-".join(str(p) for p in peers)
    if store is None:
        return f"{ERROR_KEY}/{name}"
    count = store.add(f"fxmegatron/pipeline_runners/{name}", 1)
    return f"{ERROR_KEY}/{name}/{(count - 1) // len(peers)}"


def report_failure(exc: BaseException, key: str = ERROR_KEY) -> None:
    """Tell the other ranks (through the store) that this rank failed. The first report
    wins: a rank that fails because a peer went away must not hide the peer's error."""
    store = _store()
    if store is None:
        return
    try:
        store.compare_set(key, "", f"rank {dist.get_rank()}: {type(exc).__name__}: {exc}"[:2000])
    except Exception:
        pass


def peer_failure(store, key: str = ERROR_KEY) -> Optional[str]:
    """The error a rank reported, if any."""
    try:
        if store is not None and store.check([key]):
            return store.get(key).decode(errors="replace")
    except Exception:
        return None
    return None


def _check_peers(store, key: str = ERROR_KEY) -> None:
    other = peer_failure(store, key)
    if other is not None:
        raise PipelineError("pipeline rank failed: " + other)


def wait_all(works, store=None, poll_s: float = 0.5, key: str = ERROR_KEY) -> None:
    """Wait for ``works``; every ``poll_s`` look whether another rank reported a failure.

    Gloo's send/recv works cannot be polled (``is_completed`` stays false until
    ``wait``, and a ``wait`` with a timeout breaks the connection), so a helper
    thread does the blocking wait while this one watches the store.
    """
    works = [w for w in works if w is not None]
    if not works:
        return
    if store is None:
        for w in works:
            w.wait()
        return
    errors: List[BaseException] = []

    def _wait():
        try:
            for w in works:
                w.wait()
        except BaseException as exc:   # re-raised in the caller's thread
            errors.append(exc)

    t = threading.Thread(target=_wait, daemon=True, name="fxmegatron-p2p-wait")
    t.start()
    while True:
        t.join(poll_s)
        if not t.is_alive():
            break
        _check_peers(store, key)
    if errors:
        _check_peers(store, key)     # a peer's own error explains a broken connection best
        raise errors[0]


class StageRunner:
    """Runs one pipeline rank's part of a ``Schedule``.

    ``chunks``: this rank's chunk modules by global chunk index, each called as
    ``chunk(*boundary_in, *batch_inputs)``. ``batch_inputs[c]``: positions in the
    flat batch that chunk c reads. ``specs[c]``: the tensors chunk c sends to
    chunk c+1 (shapes at microbatch size). ``peers``: global rank of each
    pipeline rank. ``group``: the pipeline process group (None for p == 1).
    """

    def __init__(self, schedule: Schedule, rank: int, chunks: Dict[int, torch.nn.Module],
                 batch_inputs: Dict[int, List[int]], specs: Dict[int, List[TensorSpec]],
                 peers: Sequence[int], group, device):
        self.schedule, self.rank, self.chunks = schedule, rank, chunks
        self.forward_schedule = forward_only(schedule)
        self.batch_inputs, self.specs, self.peers, self.group = batch_inputs, specs, list(peers), group
        self.device = device
        self.n_chunks = schedule.p * schedule.v
        self.max_tensors = max([len(s) for s in specs.values()] + [1])
        self.error_key = error_key(self.peers) if group is not None else ERROR_KEY

    # ---- tags: one per (direction, boundary, microbatch, tensor) --------------
    def _tag(self, backward: bool, boundary: int, mb: int, j: int) -> int:
        return ((int(backward) * self.n_chunks + boundary) * self.schedule.m + mb) * self.max_tensors + j

    def run(self, microbatches: List[List], weights: Sequence[float], dropout_off: bool = False) -> Optional[Tensor]:
        """Run the schedule over ``microbatches`` (flat inputs each); returns the sum of the
        weighted microbatch losses on the rank holding the last chunk, else None.
        ``dropout_off``: the chunks are in eval mode (see ``TensorSpec.eval_shape``)."""
        return self._guarded(self.schedule, microbatches, weights, dropout_off)

    def run_forward(self, microbatches: List[List], weights: Sequence[float],
                    dropout_off: bool = True) -> Optional[Tensor]:
        """``run`` without backward, for evaluation: the forward-only schedule, under
        ``no_grad``, each activation freed once consumed."""
        with torch.no_grad():
            return self._guarded(self.forward_schedule, microbatches, weights, dropout_off)

    def _guarded(self, schedule, microbatches, weights, dropout_off):
        try:
            return self._run(schedule, microbatches, weights, dropout_off)
        except PipelineError:
            raise
        except BaseException as exc:
            # a send or receive that fails because a peer died: report the peer's error
            other = peer_failure(_store(), self.error_key) if self.group is not None else None
            if other is not None and not other.startswith(f"rank {dist.get_rank()}:"):
                raise PipelineError("pipeline rank failed: " + other) from exc
            report_failure(exc, self.error_key)
            raise

    def _run(self, schedule: Schedule, microbatches, weights, dropout_off: bool):
        # gloo waits block the host: watch the store for failed peers from a helper thread.
        # NCCL waits only order streams (the host goes on), so they are called directly.
        store = _store() if self.group is not None and dist.get_backend(self.group) == "gloo" else None
        acts = schedule.ranks[self.rank]
        keep = not schedule.forward_only       # activations stay for the backward
        inputs: Dict[Tuple[int, int], List] = {}        # (mb, chunk) -> boundary inputs (leaves)
        outputs: Dict[Tuple[int, int], object] = {}     # (mb, chunk) -> outputs / loss
        out_grads: Dict[Tuple[int, int], List] = {}     # (mb, chunk) -> grads of its outputs
        in_grads: Dict[Tuple[int, int], List] = {}      # (mb, chunk) -> grads of its inputs
        recv_work: Dict[Tuple[str, int, int], list] = {}
        sends: List[Tuple[list, Tensor]] = []          # (works, tensor) of each posted send
        total = None
        i = 0
        while i < len(acts):
            a = acts[i]
            if not a.is_compute:
                j = i
                ops = []
                while j < len(acts) and not acts[j].is_compute:
                    ops += self._p2p(acts[j], outputs, in_grads, inputs, out_grads, recv_work, keep,
                                     dropout_off)
                    j += 1
                if ops:
                    works = dist.batch_isend_irecv([op for op, _ in ops])
                    if len(works) != len(ops):
                        # NCCL returns one work for the whole coalesced batch: every op waits on it
                        works = [list(works)] * len(ops)
                    else:
                        works = [[w] for w in works]
                    # a tensor being sent must outlive its send: on GPU the send runs on NCCL's
                    # stream, and a freed buffer could be handed out again before it is read
                    for (op, key), ws in zip(ops, works):
                        if key is None:
                            sends.append((ws, op.tensor))
                        else:
                            recv_work.setdefault(key, []).extend(ws)
                i = j
                continue
            key = (a.microbatch, a.chunk)
            if a.kind == "F":
                self._await(recv_work.pop(("F",) + key, []), store)
                out = self._forward(a, microbatches[a.microbatch], inputs, outputs, keep)
                if a.chunk == self.n_chunks - 1:
                    loss = out[0] if isinstance(out, (tuple, list)) else out
                    if keep:
                        outputs[key] = loss
                    total = add_weighted(total, loss, weights[a.microbatch])
                    del loss
                del out         # the dicts hold what is still to be consumed, and only that
            else:
                self._await(recv_work.pop(("B",) + key, []), store)
                self._backward(a, weights, inputs, outputs, out_grads, in_grads)
            if not keep:
                # NCCL's works tell when they are done: release sent activations then. Gloo's
                # stay incomplete until waited on, so there they are released at the end
                sends = [s for s in sends if not all(w.is_completed() for w in s[0])]
            i += 1
        self._await([w for ws, _ in sends for w in ws], store)
        sends.clear()
        for w in recv_work.values():
            self._await(w, store)
        return total

    def _await(self, works, store):
        if works:
            wait_all(works, store, key=self.error_key)

    def _forward(self, a: Action, batch, inputs, outputs, keep: bool):
        """``keep``: for a backward. Else the boundary inputs are released once passed to the chunk."""
        c, mb = a.chunk, a.microbatch
        if c == 0:
            boundary = []
        elif (mb, c - 1) in outputs and self._local(c - 1):
            prev = outputs[(mb, c - 1)] if keep else outputs.pop((mb, c - 1))
            boundary = [t.detach().requires_grad_(s.grad) if s.grad and keep else t
                        for t, s in zip(prev, self.specs[c - 1])]
        else:   # received buffers become autograd leaves once they have arrived
            received = inputs[(mb, c)] if keep else inputs.pop((mb, c))
            boundary = [t.requires_grad_(s.grad) if s.grad and keep else t
                        for t, s in zip(received, self.specs[c - 1])]
        if keep:
            inputs[(mb, c)] = boundary
        out = self.chunks[c](*boundary, *[batch[k] for k in self.batch_inputs[c]])
        if c != self.n_chunks - 1:
            outputs[(mb, c)] = out
        return out

    def _local(self, c: int) -> bool:
        return c % self.schedule.p == self.rank

    def _backward(self, a: Action, weights, inputs, outputs, out_grads, in_grads):
        c, mb = a.chunk, a.microbatch
        out = outputs.pop((mb, c))
        if c == self.n_chunks - 1:
            torch.autograd.backward(out * weights[mb])
        else:
            grads = out_grads.pop((mb, c), None)
            if grads is None:      # the next chunk ran here: take its input gradients
                grads = in_grads.pop((mb, c + 1))
            pairs = [(t, g) for t, g, s in zip(out, grads, self.specs[c]) if s.grad and t.requires_grad]
            if pairs:
                torch.autograd.backward([t for t, _ in pairs], [g for _, g in pairs])
        boundary = inputs.pop((mb, c))
        if c > 0:
            in_grads[(mb, c)] = [
                (t.grad if t.grad is not None else torch.zeros_like(t)) if s.grad else None
                for t, s in zip(boundary, self.specs[c - 1])]

    def _p2p(self, a: Action, outputs, in_grads, inputs, out_grads, recv_work, keep: bool, dropout_off: bool):
        """(P2POp, recv key or None) for one communication action."""
        peer = self.peers[a.peer]
        ops = []
        if a.kind == "SEND_F":
            key = (a.microbatch, a.chunk)
            for j, (t, s) in enumerate(zip(outputs[key] if keep else outputs.pop(key), self.specs[a.chunk])):
                ops.append((dist.P2POp(dist.isend, t.detach().contiguous(), peer, self.group,
                                       self._tag(False, a.chunk, a.microbatch, j)), None))
        elif a.kind == "RECV_F":
            bufs = []
            for j, s in enumerate(self.specs[a.chunk - 1]):
                buf = torch.empty(s.recv_shape(dropout_off), dtype=s.dtype, device=self.device)
                bufs.append(buf)
                ops.append((dist.P2POp(dist.irecv, buf, peer, self.group,
                                       self._tag(False, a.chunk - 1, a.microbatch, j)), ("F", a.microbatch, a.chunk)))
            inputs[(a.microbatch, a.chunk)] = bufs
        elif a.kind == "SEND_B":
            grads = in_grads.pop((a.microbatch, a.chunk))
            for j, (g, s) in enumerate(zip(grads, self.specs[a.chunk - 1])):
                if s.grad:
                    ops.append((dist.P2POp(dist.isend, g.contiguous(), peer, self.group,
                                           self._tag(True, a.chunk - 1, a.microbatch, j)), None))
        elif a.kind == "RECV_B":
            grads = []
            for j, s in enumerate(self.specs[a.chunk]):
                if not s.grad:
                    grads.append(None)
                    continue
                buf = torch.empty(s.shape, dtype=s.dtype, device=self.device)
                grads.append(buf)
                ops.append((dist.P2POp(dist.irecv, buf, peer, self.group,
                                       self._tag(True, a.chunk, a.microbatch, j)), ("B", a.microbatch, a.chunk)))
            out_grads[(a.microbatch, a.chunk)] = grads
        return ops
