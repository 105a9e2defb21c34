"""Expert- or tensor-parallel serving: one HTTP front end driving every rank of a node (or of several).

Launch (one process per GPU; on a CPU-only machine, gloo ranks)::

    torchrun --nproc-per-node 8 -m megamoe.service.distributed --checkpoint /ckpt --host 0.0.0.0 --port 8000
    torchrun --nproc-per-node 8 -m megamoe.service.distributed --checkpoint /ckpt --tp 8      # tensor parallel
    torchrun --nproc-per-node 2 -m megamoe.service.distributed --preset tiny --backend torch   # CPU smoke run

Flags and ``MEGAMOE_*`` variables are those of ``megamoe serve`` (megamoe.service.settings).
Several nodes: the usual ``torchrun --nnodes N --node-rank i --rdzv-endpoint host:port``;
the HTTP front end is global rank 0.

Design:

* every rank loads only its experts (:func:`megamoe.distributed.load_shard`) into an
  :class:`~megamoe.distributed.ExpertParallelMoE`, or with ``--tp N`` (N = the number of
  ranks) only its 1/N slice of every expert (:func:`megamoe.distributed.load_tp_shard`) into a
  :class:`~megamoe.distributed.TensorParallelMoE`; the ranks then agree that every one
  of them loaded (or all exit with the failing ranks' errors);
* rank 0 runs the unchanged service app (:func:`megamoe.service.app.create_app`) with a
  :class:`DistributedFront` as its layer. The front has the attributes the service reads
  from a MoELayer (``config``, ``backend``, ``device``, ``weights``, ``forward``) and
  ``run_checks(level)``;
* ``DistributedFront.forward`` broadcasts a small header (operation, T, dtype, routing
  mode, whether token ids come) on a gloo *control* group. Expert parallelism: it scatters
  the batch's rows in equal chunks (rank r gets rows ``[r*c, (r+1)*c)``, ``c = ceil(T/W)``,
  the last ranks possibly none), every rank runs the collective EP forward on its chunk
  (dispatch/combine by all-to-all), and the outputs are gathered back to rank 0 in order.
  Tensor parallelism: it broadcasts the whole batch, every rank runs the collective TP
  forward on it (the partial sums added in rank order), and rank 0 answers with its copy
  of the sum (every rank holds the same bits);
* ranks 1.. run :func:`serve_worker`: wait for a header, do what it says, repeat;
* ``run_checks(level)`` makes every rank run the docs/SPEC.md §5 checks on its own backend plus
  the EP dispatch/combine check (or the TP sum check), and returns rank 0's merged report (one entry per check
  name, ``failed on ranks [...]``, every rank's full report under ``ranks``);
* shutdown: when uvicorn returns (SIGTERM/SIGINT), rank 0 sends STOP and all ranks leave.

The control group is gloo with a long timeout (workers wait between requests as long
as the server is idle); the data group (NCCL on GPUs) keeps the short default, since a
collective that stalls mid-forward means a rank is gone.

Health: the service's self-test calls ``layer.run_checks(level)`` when the layer has one
(service/app.py ``ServiceState.run_selftest``), so ``/v1/health/kernels`` and the
readiness gate cover every rank. Failures: a collective that fails (a rank died, a
timeout) marks the front ``broken``; every later forward and self-test raises, so
readiness turns 503 at the next self-test, and torchrun ends the whole job when a worker
process exits with an error (the orchestrator restarts it).
"""

from __future__ import annotations

import datetime
import logging
import math
import os
import signal
import threading

import torch
import torch.distributed as dist

from megamoe.distributed import (ExpertParallelMoE, TensorParallelMoE, global_rank, init_distributed,
                                  run_checks_all_ranks)

log = logging.getLogger("megamoe.service.distributed")

__all__ = ["DistributedFront", "serve_worker", "build_layer", "tp_mismatch", "main", "OP_STOP", "OP_FORWARD", "OP_HEALTH"]

OP_STOP, OP_FORWARD, OP_HEALTH = 0, 1, 2
MODES = ("router", "topk", "logits")
DTYPES = (torch.bfloat16, torch.float16, torch.float32)
LEVELS = ("quick", "full")
HEADER_LEN = 7  # op, T, dtype code, mode code, level code, seed (-1: fresh), input_ids sent (0/1)
CONTROL_TIMEOUT = datetime.timedelta(days=30)


def _header(op: int, tokens: int = 0, dtype: int = 0, mode: int = 0, level: int = 0, seed: int = -1,
            input_ids: int = 0) -> torch.Tensor:
    return torch.tensor([op, tokens, dtype, mode, level, seed, input_ids], dtype=torch.int64)


def _chunk(tokens: int, world: int) -> int:
    return max(1, math.ceil(tokens / world))


def _rows_of(rank: int, tokens: int, world: int) -> int:
    c = _chunk(tokens, world)
    return max(0, min(c, tokens - rank * c))


def _scatter_rows(full: torch.Tensor | None, tokens: int, width: int, dtype: torch.dtype, layer: ExpertParallelMoE,
                  ) -> torch.Tensor:
    """Rank 0's ``full [T, width]`` split in chunks of ``ceil(T/W)`` rows; returns this rank's rows."""
    world, rank, c = layer.world_size, layer.rank, _chunk(tokens, layer.world_size)
    out = torch.empty((c, width), dtype=dtype, device=layer.device)
    parts = None
    if rank == 0:
        padded = torch.zeros((c * world, width), dtype=dtype, device=layer.device)
        padded[:tokens] = full.to(layer.device, dtype)
        parts = list(padded.split(c))
    dist.scatter(out, parts, src=global_rank(layer.group, 0), group=layer.group)
    return out[: _rows_of(rank, tokens, world)]


def _gather_rows(rows: torch.Tensor, tokens: int, layer: ExpertParallelMoE) -> torch.Tensor | None:
    """Every rank's output rows back on rank 0, in the original order (None elsewhere)."""
    world, c = layer.world_size, _chunk(tokens, layer.world_size)
    padded = torch.zeros((c, rows.shape[1]), dtype=rows.dtype, device=layer.device)
    padded[: rows.shape[0]] = rows
    parts = [torch.empty_like(padded) for _ in range(world)] if layer.rank == 0 else None
    dist.gather(padded, parts, dst=global_rank(layer.group, 0), group=layer.group)
    return torch.cat(parts)[:tokens] if layer.rank == 0 else None


def _broadcast_rows(full: torch.Tensor | None, tokens: int, width: int, dtype: torch.dtype, layer) -> torch.Tensor:
    """Rank 0's ``full [T, width]`` on every rank (tensor parallelism: every rank runs all the rows)."""
    out = torch.empty((tokens, width), dtype=dtype, device=layer.device)
    if layer.rank == 0:
        out.copy_(full.reshape(tokens, width))
    dist.broadcast(out, src=global_rank(layer.group, 0), group=layer.group)
    return out


def _forward_step(layer: ExpertParallelMoE | TensorParallelMoE, header: torch.Tensor, x=None, topk_ids=None,
                  topk_weights=None, router_logits=None, input_ids=None) -> torch.Tensor | None:
    """The part of one batched forward every rank runs (rank 0 passes the tensors)."""
    _, tokens, dtype_code, mode_code = (int(v) for v in header[:4])
    has_ids = bool(int(header[6]))
    cfg, dtype, mode = layer.config, DTYPES[dtype_code], MODES[mode_code]
    tp = isinstance(layer, TensorParallelMoE)
    rows = _broadcast_rows if tp else _scatter_rows
    xs = rows(x, tokens, cfg.hidden_size, dtype, layer)
    kw = {}
    if mode == "topk":
        kw["topk_ids"] = rows(topk_ids, tokens, cfg.top_k, torch.int32, layer)
        kw["topk_weights"] = rows(topk_weights, tokens, cfg.top_k, torch.float32, layer)
    elif mode == "logits":
        kw["router_logits"] = rows(router_logits, tokens, cfg.num_experts, torch.float32, layer)
    if has_ids:
        kw["input_ids"] = rows(None if input_ids is None else input_ids.reshape(-1, 1), tokens, 1, torch.int64,
                               layer).reshape(-1)
    # rank 0 validated the whole batch; a worker trusts it (a raise here would strand the others)
    y = layer.forward(xs, validate=False, **kw)
    if tp:
        return y if layer.rank == 0 else None
    return _gather_rows(y, tokens, layer)


class DistributedFront:
    """Rank 0's stand-in for a :class:`~megamoe.moe.MoELayer` in the service, driving all ranks.

    Attributes read by the service: ``config`` (the global MoEConfig), ``backend`` (rank 0's),
    ``device``, ``weights`` (``router_weight`` tells whether the model routes itself),
    ``needs_input_ids`` (a hash-routed layer).
    Methods: ``forward(hidden_states, topk_ids=, topk_weights=, router_logits=, input_ids=)`` and
    ``run_checks(level)``; both are collectives over every rank and are serialised by a lock
    (the service already calls them from one device thread). ``stop()`` releases the workers.
    """

    def __init__(self, layer: ExpertParallelMoE | TensorParallelMoE, control_group) -> None:
        if layer.rank != 0:
            raise ValueError(f"the front end runs on rank 0, not rank {layer.rank}")
        self.layer = layer
        self.control = control_group
        self.config = layer.config
        self.backend = layer.backend
        self.device = layer.device
        self.weights = layer.weights
        self.world_size = layer.world_size
        self._lock = threading.Lock()
        self._stopped = False
        self.broken: str | None = None  # set when a collective failed: the ranks are out of step for good

    def _collective(self, header: torch.Tensor, step):
        """Broadcast ``header``, then run ``step()`` (this rank's part of the same operation)."""
        if self._stopped:
            raise RuntimeError("the distributed front end was stopped: the worker ranks are gone")
        if self.broken:
            raise RuntimeError(f"the distributed front end is broken (an earlier collective failed: {self.broken}); "
                               f"restart the job")
        try:
            dist.broadcast(header, src=0, group=self.control)
            return step()
        except Exception as exc:
            # a rank died or a collective failed half way: the ranks no longer agree on what comes next.
            # (torchrun also tears the whole job down when a worker process exits with an error.)
            self.broken = f"{type(exc).__name__}: {exc}"
            log.error("collective failed, the front end stops serving: %s", self.broken)
            raise

    @property
    def needs_input_ids(self) -> bool:
        """True when the layer routes by token id (hash routing): its own router needs ``input_ids``."""
        return bool(getattr(self.layer, "needs_input_ids", False))

    def forward(self, hidden_states: torch.Tensor, topk_ids=None, topk_weights=None, router_logits=None,
                validate: bool = True, input_ids=None) -> torch.Tensor:
        """One batched forward over every rank; ``[T, H]`` in the dtype of ``hidden_states``."""
        if validate:  # bad input is refused here, before any rank is involved
            self.layer._check_inputs(hidden_states, topk_ids, topk_weights, router_logits, input_ids)
        if hidden_states.dtype not in DTYPES:
            raise TypeError(f"hidden_states dtype {hidden_states.dtype}: expected one of {DTYPES}")
        mode = "topk" if topk_ids is not None else ("logits" if router_logits is not None else "router")
        if mode == "router" and self.weights.router_weight is None:
            raise ValueError("this layer has no router weight: pass topk_ids/topk_weights or router_logits")
        if mode != "topk" and input_ids is None and self.needs_input_ids:
            from megamoe.routing import InputIdsRequired

            raise InputIdsRequired("this layer routes by token id (hash routing): pass input_ids [T], or "
                                   "topk_ids and topk_weights")
        if mode == "topk":
            input_ids = None  # the caller's routing: token ids are not used
        tokens = hidden_states.shape[0]
        header = _header(OP_FORWARD, tokens, DTYPES.index(hidden_states.dtype), MODES.index(mode),
                         input_ids=int(input_ids is not None))
        with self._lock:
            return self._collective(header, lambda: _forward_step(self.layer, header, hidden_states, topk_ids,
                                                                  topk_weights, router_logits, input_ids))

    __call__ = forward

    def run_checks(self, level: str = "quick", seed: int | None = None) -> dict:
        """docs/SPEC.md §5 on every rank (+ ep_dispatch_combine), merged on rank 0."""
        if level not in LEVELS:
            raise ValueError(f"level must be 'quick' or 'full', got {level!r}")
        header = _header(OP_HEALTH, level=LEVELS.index(level), seed=-1 if seed is None else seed)
        with self._lock:
            return self._collective(header, lambda: run_checks_all_ranks(self.layer, level, seed=seed))

    def stop(self) -> None:
        """Tell every worker rank to leave its loop (idempotent)."""
        with self._lock:
            if not self._stopped:
                dist.broadcast(_header(OP_STOP), src=0, group=self.control)
                self._stopped = True

    def __repr__(self) -> str:
        return f"DistributedFront({self.layer!r}, {self.world_size} ranks)"


def serve_worker(layer: ExpertParallelMoE | TensorParallelMoE, control_group) -> int:
    """Ranks 1..W-1: run what rank 0 broadcasts until STOP; returns the number of forwards run."""
    forwards = 0
    while True:
        header = _header(OP_STOP)
        dist.broadcast(header, src=0, group=control_group)
        op = int(header[0])
        if op == OP_STOP:
            return forwards
        if op == OP_FORWARD:
            _forward_step(layer, header)
            forwards += 1
        elif op == OP_HEALTH:
            seed = int(header[5])
            run_checks_all_ranks(layer, LEVELS[int(header[4])], seed=None if seed < 0 else seed)
        else:
            raise RuntimeError(f"rank {layer.rank}: unknown operation {op} from rank 0")


def build_layer(settings, group=None) -> ExpertParallelMoE | TensorParallelMoE:
    """This rank's layer from the service settings (checkpoint or synthetic preset): a
    TensorParallelMoE with ``--tp N`` (N > 1), else an ExpertParallelMoE."""
    from .model import resolve_backend

    cls = TensorParallelMoE if getattr(settings, "tp", 1) > 1 else ExpertParallelMoE
    backend = resolve_backend(settings.backend)
    if settings.checkpoint:
        layer = cls.from_checkpoint(settings.checkpoint, backend=backend, device=settings.device, group=group,
                                    layer=settings.layer)
    else:
        layer = cls.from_preset(settings.preset, seed=settings.seed, backend=backend, device=settings.device,
                                group=group)
    layer.batch_invariant = getattr(settings, "batch_invariant", True)
    return layer


def tp_mismatch(tp: int, world: int) -> str | None:
    """Why ``--tp tp`` cannot run on ``world`` ranks (tensor parallelism spans every rank), or None."""
    if tp > 1 and tp != world:
        return (f"--tp {tp}: tensor parallelism runs over every rank of the job, which has {world}; launch {tp} "
                f"processes (torchrun --nproc-per-node {tp}) or leave --tp at 1 for expert parallelism")
    return None


def _agree_loaded(control, error: str | None) -> None:
    """Every rank learns whether every rank loaded; if one failed, all raise with its error."""
    errors = [None] * dist.get_world_size()
    dist.all_gather_object(errors, error, group=control)
    failed = {r: e for r, e in enumerate(errors) if e}
    if failed:
        raise RuntimeError("ranks failed to load: " + "; ".join(f"rank {r}: {e}" for r, e in failed.items()))


def main(argv: list[str] | None = None) -> int:
    """torchrun entry point: rank 0 serves HTTP, the other ranks run :func:`serve_worker`."""
    import sys

    import uvicorn

    from .app import create_app
    from .settings import parse_settings

    settings = parse_settings(sys.argv[1:] if argv is None else argv)
    if settings.instances > 1:
        # before any rendezvous: every rank refuses alike, none waits for the others
        print(f"megamoe.service.distributed: --instances {settings.instances} is not supported with torchrun: "
              "expert-parallel serving runs one serving process per rank (rank 0 serves HTTP); leave "
              "--instances (MEGAMOE_INSTANCES) at 1", file=sys.stderr)
        return 2
    # torchrun's own description of the job (before any rendezvous: every rank refuses alike)
    why = tp_mismatch(getattr(settings, "tp", 1), int(os.environ.get("WORLD_SIZE", "1")))
    if why:
        print(f"megamoe.service.distributed: {why}", file=sys.stderr)
        return 2
    logging.basicConfig(level=settings.log_level.upper(),
                        format=f"%(asctime)s %(levelname)s rank {os.environ.get('RANK', '?')} %(name)s: %(message)s")
    rank, world, _ = init_distributed(timeout_s=600)
    if getattr(settings, "torch_threads", None):  # every rank, not only rank 0 (the app sets its own)
        torch.set_num_threads(settings.torch_threads)
    control = dist.new_group(backend="gloo", timeout=CONTROL_TIMEOUT)
    layer, error = None, None
    try:
        layer = build_layer(settings)
        log.info("loaded %r", layer)
    except Exception as exc:  # noqa: BLE001 - every rank must hear about it, or the others hang
        error = f"{type(exc).__name__}: {exc}"
        log.exception("loading failed")
    try:
        _agree_loaded(control, error)
        # torchrun forwards SIGTERM/SIGINT to every rank. uvicorn drains rank 0's requests and then
        # re-raises the signal to the handler found before it started: this one, so rank 0 goes on
        # to send STOP instead of dying; the workers wait for that STOP (a stuck one gets
        # torchrun's SIGKILL).
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda signum, frame: log.info("rank %d: signal %d, shutting down via rank 0",
                                                              rank, signum))
        if rank == 0:
            front = DistributedFront(layer, control)
            try:
                uvicorn.run(create_app(settings, layer=front), host=settings.host, port=settings.port,
                            log_level=settings.log_level, timeout_graceful_shutdown=settings.graceful_shutdown_s,
                            access_log=False)
            finally:
                try:
                    front.stop()
                except Exception as exc:  # noqa: BLE001 - a worker already gone; nothing left to stop
                    log.warning("could not stop the workers cleanly: %s", exc)
        else:
            n = serve_worker(layer, control)
            log.info("rank %d: stopped after %d forwards", rank, n)
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
