"""Serving-mode selection at warm-up: time each candidate (weights dtype x compiled graphs x attention kernel) on
this machine.

Which mode is fastest depends on the hardware: bf16 weights are a large win on CPUs with AMX and on GPUs, while
on an AMD EPYC without AMX compiled fp32 measured 1.25-5x *slower* than eager fp32; the explicit three-op attention
(``vla.models.attention.grouped_attention``) beat SDPA's fused kernel in bf16 on AVX-512-BF16 EPYCs. So ``vla
serve`` does not guess: each candidate is prepared (``FlowVLA.prepare_inference``), warmed up, and timed at the
batch sizes the server will run (1 and ``--max-batch``) on synthetic observations of every served embodiment; a
candidate whose chunk differs from the eager fp32 SDPA chunk (same observations, same noise seeds) by more than
``tolerance`` (1 %) of that chunk's largest magnitude is refused; the fastest remaining one is kept and logged.

An attention kernel left open is measured without a second compile: eager modes are timed with both kernels
(prepared once, the kernels alternating call by call: timed one after the other, a shared VM's drift of 10-30 %
over seconds decided between kernels a few percent apart, and a server kept SDPA where the explicit form was 6 %
faster at batch 8 when interleaved), and a compiled mode takes the kernel that won the eager trials of its dtype
(both where no eager trial of its dtype ran or was accepted). A model with attention logit soft-capping (Gemma2)
has only the explicit form. Every trial starts from the weights as loaded (``prepare_inference`` casts in place:
without that, a float32 trial after a bf16 one would run bf16-rounded weights).
"""

from __future__ import annotations

import logging
import statistics
import time
from dataclasses import dataclass

import numpy as np
import torch

from vla.models.attention import INFERENCE_ATTENTION, check_inference_attention
from vla.policy import ActionSafetyError, Policy
from vla.types import Observation

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Mode:
    """One way to run the model: weights ``dtype``, whether the serving graphs are compiled, and the attention
    kernel (``INFERENCE_ATTENTION``; None in a candidate: to be measured)."""

    dtype: str
    compile: bool
    attention: str | None = "sdpa"

    def __str__(self) -> str:
        return f"{self.dtype} {'compiled' if self.compile else 'eager'} {self.attention or 'sdpa|explicit'}"

    def to_dict(self) -> dict[str, object]:
        """``mode`` (``str(self)``), ``dtype``, ``compile``, ``attention``: for the metadata and the ready line."""
        return {"mode": str(self), "dtype": self.dtype, "compile": self.compile, "attention": self.attention}


#: The accuracy reference every candidate is compared with.
REFERENCE = Mode("float32", False, "sdpa")


@dataclass(frozen=True)
class Trial:
    """A candidate's measurement: median seconds per chunk at each batch size, and its error vs eager fp32."""

    mode: Mode
    seconds_per_chunk: dict[int, float]
    rel_error: float
    accepted: bool

    def to_dict(self) -> dict[str, object]:
        return {
            "mode": str(self.mode),
            # string keys: msgpack map keys must be strings for openpi's client (strict_map_key) and JSON
            "ms_per_chunk": {str(b): round(s * 1000, 3) for b, s in self.seconds_per_chunk.items()},
            "rel_error": self.rel_error,
            "accepted": self.accepted,
        }


def candidates(
    dtype: str | None,
    compile: bool | None,
    device: str,
    *,
    attention: str | None = None,
    bf16_slowdown: float | None = None,
) -> list[Mode]:
    """The modes to try: the user's choice when all are given, else every combination left open, except bf16
    on a CPU that emulates it (a bf16 matmul more than ``BF16_EMULATED_SLOWDOWN`` times slower than fp32,
    ``bf16_slowdown``, measured here when None; an AVX2-only AMD EPYC measured 30-80x, where one bf16 trial would
    take minutes and could never win). ``attention`` None leaves the kernel to ``select_mode``."""
    if attention is not None:
        check_inference_attention(attention)
    from vla.runtime import BF16_EMULATED_SLOWDOWN, cpu_bf16_slowdown

    dtypes = [dtype] if dtype else ["float32", "bfloat16"]
    if dtype != "float32" and device.split(":")[0] == "cpu":
        slowdown = cpu_bf16_slowdown() if bf16_slowdown is None else bf16_slowdown
        if slowdown > BF16_EMULATED_SLOWDOWN:
            why = f"a bf16 matmul takes {slowdown:.0f}x the time of fp32 on this CPU: no bf16 units"
            if dtype is None:
                log.info("serving modes: bf16 left out (%s); trying float32 only", why)
                dtypes = ["float32"]
            else:
                log.warning("--dtype bfloat16 kept although %s (--dtype float32 would be faster)", why)
    compiles = [compile] if compile is not None else [False, True]
    return [Mode(d, c, attention) for d in dtypes for c in compiles]


#: Warm-up instructions of different token counts: a compiled graph specializes on the first prompt length it sees
#: and recompiles (once, as dynamic) at the second; warm-up must pay that, not the first real request.
WARM_UP_PROMPTS = (
    "pick up the red cube",
    "put the red cube into the blue bowl on the left side of the table, then push the bowl to the right edge",
)


def synthetic_observations(
    policy: Policy,
    n: int,
    seed: int = 0,
    *,
    embodiment: str | None = None,
    prompts: tuple[str, ...] = WARM_UP_PROMPTS[:1],
    cameras: int | None = None,
) -> list[Observation]:
    """``n`` observations cycling over the served embodiments (or all of ``embodiment``) and over ``prompts``:
    random pixels at each camera's native size (the spec's first ``cameras`` cameras; all by default) and a state in
    the middle of the spec's limits (0 where unbounded)."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        spec = policy.spec(embodiment or policy.embodiments[i % len(policy.embodiments)])
        images = {
            s: rng.integers(0, 256, (c.height, c.width, 3), dtype=np.uint8)
            for s, c in list(spec.cameras.items())[:cameras]
        }
        lo, hi = spec.limits("state")
        state = np.where(np.isfinite(lo) & np.isfinite(hi), (np.nan_to_num(lo) + np.nan_to_num(hi)) / 2, 0.0)
        out.append(Observation(images, state.astype(np.float32), prompts[i % len(prompts)], spec.name))
    return out


def warm_up(policy: Policy, batch_sizes: list[int]) -> None:
    """Run the shapes requests bring, so that compiled graphs are built (and their varying dimensions marked
    dynamic) before ``/healthz`` turns OK: at each batch size, each served embodiment alone (its cameras, state
    width and chunk length) with each of ``WARM_UP_PROMPTS`` (two prompt token counts), then all embodiments and
    both prompts mixed in one batch. Dynamo specializes a graph on the first shapes it sees and recompiles once, as
    dynamic, when a dimension changes; without this the first real request with a new prompt length would.
    A request may leave cameras out (they are masked): one with a single image is a vision batch of 1, a size
    Dynamo always specializes, so each multi-camera embodiment also runs once with its first camera only (a
    recompile of seconds, which would otherwise stall every client at the first such request), at batch 1."""
    for b in sorted(set(batch_sizes)):
        for embodiment in policy.embodiments:
            for prompt in WARM_UP_PROMPTS:
                obs = synthetic_observations(policy, b, seed=b, embodiment=embodiment, prompts=(prompt,))
                policy.infer_batch(obs, seeds=list(range(b)))
        if b > 1:
            obs = synthetic_observations(policy, b, seed=b, prompts=WARM_UP_PROMPTS)
            policy.infer_batch(obs, seeds=list(range(b)))
    for embodiment in policy.embodiments:  # a lone request with one camera: whatever the batch sizes
        if len(policy.spec(embodiment).cameras) > 1:
            policy.infer_batch(synthetic_observations(policy, 1, embodiment=embodiment, cameras=1), seeds=[0])


def select_mode(
    policy: Policy,
    modes: list[Mode],
    batch_sizes: list[int],
    *,
    repeats: int = 3,
    tolerance: float = 0.01,
) -> tuple[Mode, list[Trial]]:
    """Time ``modes`` and leave ``policy.model`` prepared in the fastest accurate one. A mode whose attention is
    None is timed with both kernels where eager, and with the winner of its dtype's accepted eager trials where
    compiled (both when there is none); a soft-capped model's language layers run the explicit form whatever the
    kernel (only it has soft-capping), so there the kernel is its vision tower's. A single mode with its
    kernel set is only prepared and warmed up (nothing to compare). A candidate whose chunk is non-finite
    (``ActionSafetyError``, e.g. a bf16 overflow) is logged and left out; when every candidate is, that error is
    raised (nothing can be served)."""
    batch_sizes = sorted(set(batch_sizes))
    if len(modes) == 1 and modes[0].attention is not None:
        _prepare(policy, modes[0])
        if modes[0].compile:
            warm_up(policy, batch_sizes)  # every embodiment, two prompt lengths, each batch size
        else:
            _time(policy, batch_sizes, repeats=0)  # eager: nothing to compile, one call per batch size
        return modes[0], []
    loaded = _LoadedWeights(policy.model)
    probe = synthetic_observations(policy, max(batch_sizes))
    seeds = list(range(len(probe)))

    def chunks() -> np.ndarray:
        return np.concatenate([c.actions.ravel() for c in policy.infer_batch(probe, seeds=seeds)])

    reference_mode = Mode("float32", False, "sdpa")
    loaded.prepare(policy, reference_mode)
    reference = chunks()
    scale = float(np.abs(reference).max()) or 1.0
    trials: list[Trial] = []
    prepared: Mode | None = reference_mode  # what policy.model runs now (None: unknown)
    unsafe: ActionSafetyError | None = None
    for candidate in modes:
        kernels = [candidate.attention] if candidate.attention else list(INFERENCE_ATTENTION)
        if candidate.attention is None and candidate.compile:
            eager = [
                t for t in trials if t.mode.dtype == candidate.dtype and not t.mode.compile and t.accepted
            ]
            if eager:  # the eager winner's kernel: no second compile
                kernels = [_fastest(eager).mode.attention]
        if len(kernels) > 1 and not candidate.compile:
            # eager: prepared once, the kernels switched call by call and timed interleaved, so that a shared
            # machine's drift over seconds (10-30 % measured) does not decide between two near-equal kernels
            loaded.prepare(policy, Mode(candidate.dtype, False, kernels[0]))
            errors = {}
            for kernel in kernels:
                policy.model.set_inference_attention(kernel)
                prepared = Mode(candidate.dtype, False, kernel)
                try:
                    errors[kernel] = float(np.abs(chunks() - reference).max()) / scale
                except ActionSafetyError as e:
                    unsafe = _refuse(prepared, e)
            kernels = list(errors)
            if not kernels:
                continue
            try:
                timings = _time_kernels(policy, batch_sizes, kernels, repeats=repeats)
            except ActionSafetyError as e:  # non-finite at another batch size
                unsafe = _refuse(Mode(candidate.dtype, False, "|".join(kernels)), e)
                prepared = None  # whichever kernel the timing left set
                continue
            for kernel in kernels:
                mode, error = Mode(candidate.dtype, False, kernel), errors[kernel]
                trial = Trial(mode, timings[kernel], error, error <= tolerance)
                trials.append(trial)
                log.info("serving mode %s: %s", trial.mode, trial.to_dict())
            policy.model.set_inference_attention(kernels[-1])  # the last trial's mode is what stays prepared
            prepared = Mode(candidate.dtype, False, kernels[-1])
            continue
        for kernel in kernels:
            mode = Mode(candidate.dtype, candidate.compile, kernel)
            loaded.prepare(policy, mode)
            prepared = mode
            try:
                rel = float(np.abs(chunks() - reference).max()) / scale
                timing = _time(policy, batch_sizes, repeats=repeats)
            except ActionSafetyError as e:
                unsafe = _refuse(mode, e)
                continue
            trial = Trial(mode, timing, rel, rel <= tolerance)
            trials.append(trial)
            log.info("serving mode %s: %s", mode, trial.to_dict())
    if not trials:  # every candidate produced non-finite chunks: nothing to serve
        assert unsafe is not None
        raise unsafe
    accepted = [t for t in trials if t.accepted]
    if not accepted:  # only modes the user asked for were tried: keep their choice, say so
        log.warning(
            "every requested serving mode is off the fp32 chunk by more than %g; keeping it", tolerance
        )
        accepted = trials
    best = _fastest(accepted)
    if best.mode != prepared:  # the mode prepared last is warm already
        loaded.prepare(policy, best.mode)
    if best.mode.compile:  # compile the kept graphs for every shape family before the first request
        warm_up(policy, batch_sizes)
    return best.mode, trials


def _refuse(mode: Mode, error: ActionSafetyError) -> ActionSafetyError:
    """Log a candidate left out for its non-finite chunk; returns the error (raised when no candidate is left)."""
    log.warning("serving mode %s refused: its warm-up chunk is not finite (%s)", mode, error)
    return error


def time_forward(policy: Policy) -> float:
    """Seconds of one batch-1 forward pass in the policy's current mode (after a warm-up call)."""
    return _time(policy, [1], repeats=1)[1]


def _fastest(trials: list[Trial]) -> Trial:
    return min(trials, key=lambda t: statistics.fmean(t.seconds_per_chunk.values()))


def _prepare(policy: Policy, mode: Mode) -> None:
    policy.model.prepare_inference(mode.dtype, compile=mode.compile, attention=mode.attention or "sdpa")


class _LoadedWeights:
    """The model's floating parameters and buffers as loaded (CPU copies, non-persistent buffers included, a tied
    parameter once), put back before each trial: ``prepare_inference`` casts in place, so a float32 trial after a
    bf16 one would otherwise run (and keep) bf16-rounded weights. Copies are made only when a trial casts."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.params: dict[int, tuple[torch.nn.Parameter, torch.Tensor]] = {}
        # a buffer shared by several modules once: id -> (its (module, name) owners, the copy)
        self.buffers: dict[int, tuple[list[tuple[torch.nn.Module, str]], torch.Tensor]] = {}
        self.dtypes = {t.dtype for t in (*model.parameters(), *model.buffers()) if t.is_floating_point()}
        self.model = model

    def prepare(self, policy: Policy, mode: Mode) -> None:
        """Put the loaded weights back (when a cast happened since loading) and prepare ``mode``."""
        if self.params or self.buffers:
            policy.model.release_serving_graphs()  # the last trial's compiled graphs hold copies of its weights
            self._restore()
        elif self.dtypes - {getattr(torch, mode.dtype)}:  # this trial casts: keep the weights as loaded first
            self._copy()
        _prepare(policy, mode)

    def _copy(self) -> None:
        for module in self.model.modules():
            for p in module.parameters(recurse=False):
                if p.is_floating_point() and id(p) not in self.params:
                    self.params[id(p)] = (p, p.detach().to("cpu", copy=True))
            for name, b in module.named_buffers(recurse=False):
                if b is not None and b.is_floating_point():
                    if id(b) not in self.buffers:
                        self.buffers[id(b)] = ([], b.detach().to("cpu", copy=True))
                    self.buffers[id(b)][0].append((module, name))

    def _restore(self) -> None:
        with torch.no_grad():
            for p, saved in self.params.values():
                p.data = saved.to(p.device, copy=True)
            for owners, saved in self.buffers.values():
                module, name = owners[0]
                current = module._buffers[name]
                restored = saved.to(current.device if current is not None else "cpu", copy=True)
                for module, name in owners:
                    module._buffers[name] = restored


def _time_kernels(
    policy: Policy, batch_sizes: list[int], kernels: list[str], *, repeats: int
) -> dict[str, dict[int, float]]:
    """Median seconds per chunk of each attention kernel at each batch size, the kernels alternating call by call
    (after one warm-up call of each, ``repeats`` rounds rounded up to even, in ABBA order: each kernel goes first
    equally often) on an eager model: ``{kernel: {batch: seconds}}``."""
    out: dict[str, dict[int, float]] = {kernel: {} for kernel in kernels}
    rounds = max(2, repeats + repeats % 2)
    for b in batch_sizes:
        obs = synthetic_observations(policy, b, seed=b)
        times: dict[str, list[float]] = {kernel: [] for kernel in kernels}
        for i in range(rounds + 1):  # round 0 warms each kernel up and is not counted
            for kernel in kernels if i % 2 == 0 else kernels[::-1]:
                policy.model.set_inference_attention(kernel)
                start = time.perf_counter()
                policy.infer_batch(obs, seeds=list(range(b)))
                if i:
                    times[kernel].append(time.perf_counter() - start)
        for kernel in kernels:
            out[kernel][b] = statistics.median(times[kernel]) / b
    return out


def _time(policy: Policy, batch_sizes: list[int], *, repeats: int) -> dict[int, float]:
    """Median seconds per chunk at each batch size; ``repeats=0`` only warms up. Every batch size is warmed up
    (compiled, when compiling) before any is timed, and the timed calls go round the batch sizes ``repeats`` times:
    no timing runs right after a compile, and a drifting machine slows every batch size alike."""
    obs = {b: synthetic_observations(policy, b, seed=b) for b in batch_sizes}
    for b in batch_sizes:
        policy.infer_batch(obs[b], seeds=list(range(b)))  # warm-up
    times: dict[int, list[float]] = {b: [] for b in batch_sizes}
    for _ in range(repeats):
        for b in batch_sizes:
            start = time.perf_counter()
            policy.infer_batch(obs[b], seeds=list(range(b)))
            times[b].append(time.perf_counter() - start)
    return {b: statistics.median(t) / b for b, t in times.items() if t}
