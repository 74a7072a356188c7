"""``WatchConfig``: what a monitor measures and where it sends it."""
from __future__ import annotations

from dataclasses import dataclass, field

from gradloc.config.options import (
    REMEDIES,
    UPDATE_RATIO_MODES,
    DistributedMode,
    LayerGrouping,
    RemedyAction,
    TokenStatsMode,
    UpdateRatioMode,
    check,
    is_address,
)
from gradloc.config.precursors import PrecursorConfig
from gradloc.config.stages import DetectorConfig, LocalizerConfig, SampleConfig


@dataclass(frozen=True)
class WatchConfig:
    """What a monitor measures and where it sends it.

    Memory: gradloc's persistent memory stays within ``memory_budget_bytes`` (default
    max(2% of the trainable parameters' bytes, 64 MiB)). The update-to-weight ratios need a copy of
    the parameters from before ``optimizer.step()``: ``update_ratio="lean"`` (default) copies a
    rotating window of them that fits the budget less gradloc's other persistent tensors and a
    16 MiB reserve for its other state, and at most a quarter of them (``LEAN_SWEEP_STEPS``), so
    every layer gets a ratio every ⌈parameter bytes / window⌉ ≥ 4 steps; ``"full"`` copies all of
    them every step (1× parameter bytes);
    ``"off"`` measures none. ``True``/``False`` mean ``"lean"``/``"off"``.

    Cost: gradloc times its own work every step (``StepRecord.overhead``). When its smoothed cost
    exceeds ``max_overhead`` of the training step's own time it sheds optional work — first the
    update ratios, then the per-layer breakdown of token scores — and names what it shed in each
    record (``StepRecord.shed``). Detection is never shed. The default 0.5 is a guardrail against
    pathological cases (real models cost a few percent; a tiny toy model ~25% of its tiny step);
    a production budget is e.g. ``max_overhead=0.05``. ``None`` measures without ever shedding.

    Remedy (opt-in, observability first): ``remedy="drop_culprits"`` replaces the gradient of a
    step whose culprits were located *and verified by probes* with ∇ − ∇_C (the update as if the
    culprit tokens had been masked out of the loss); ``"skip_step"`` drops the whole update of such
    a step (every gradient set to None). Diffuse, unverified or unlocated spikes are never remedied.
    """

    job: str = "default"
    rank: int = 0
    token_stats: bool | TokenStatsMode = True  # True | False | "on_spike" (hooks only to re-run a flagged step: engine/on_spike.py)
    top_k: int = 16  # tokens kept (with per-layer breakdown) in every StepRecord
    layer_grouping: LayerGrouping = "module"
    update_ratio: UpdateRatioMode | bool = UpdateRatioMode.LEAN  # "lean" | "full" | "off" (see the class docstring)
    memory_budget_bytes: int | None = None  # None: max(2% of trainable parameter bytes, 64 MiB)
    layer_breakdown: bool = True  # keep each token's score per layer (memory: layers × tokens × 4 B)
    max_overhead: float | None = 0.5  # shed optional work above this fraction of the step's time (None: never)
    remedy: RemedyAction | None = None  # None | "drop_culprits" | "skip_step"
    history: int = 256  # StepRecords kept in Monitor.history
    distributed: DistributedMode = DistributedMode.AUTO  # "auto": an initialised torch.distributed job of > 1 rank is watched as one; "off"
    collective_timeout_s: float = 60.0  # every gradloc collective is waited on at most this long
    close_timeout_s: float = 1.0  # Monitor.close() (and interpreter exit) waits at most this long on the agent
    strict: bool = True  # wiring mistakes (shape mismatch) raise BatchMetadataError at block exit
    incident_path: str | None = None  # JSONL incident file (embedded mode)
    world_size: int = 1  # ranks in the job: the agent waits for all of them before closing an incident
    agent: str | None = None  # "host:port" of a gradloc-agent daemon: ship records there
    agent_token: str | None = field(default=None, repr=False)  # its bearer token (else $GRADLOC_AGENT_AUTH_TOKEN)
    agent_tls_ca: str | None = None  # TLS to the agent, trusting this PEM CA / certificate
    embedded: bool = True  # without an agent: run the store and exporters in-process
    store_path: str | None = None  # embedded SQLite store (None: $GRADLOC_DB or the per-user default)
    store: bool = True  # embedded mode keeps incidents in the SQLite store
    metrics_address: str | None = None  # embedded mode: serve /metrics and /api here, e.g. "127.0.0.1:9917"
    otlp_endpoint: str | None = None  # embedded mode: export metrics and traces over OTLP/gRPC
    # embedded mode's quarantine policy (a daemon's: serve --quarantine-culprits / --quarantine-outlier-z): every
    # sample a located incident names, every surprise outlier at or above this z (0: none) goes on the store's list
    quarantine_culprits: bool = False
    quarantine_outlier_z: float = 0.0
    detector: DetectorConfig = field(default_factory=DetectorConfig)
    localizer: LocalizerConfig = field(default_factory=LocalizerConfig)
    samples: SampleConfig = field(default_factory=SampleConfig)  # per-sample outlier findings
    precursors: PrecursorConfig = field(default_factory=PrecursorConfig)  # slow instabilities' statistics

    def __post_init__(self) -> None:
        check(bool(self.job) and isinstance(self.job, str), "job must be a non-empty string")
        check(self.rank >= 0, f"rank must be >= 0, got {self.rank}")
        check(self.top_k >= 1, f"top_k must be >= 1, got {self.top_k}")
        check(self.world_size >= 1 and self.rank < self.world_size,
               f"need 0 <= rank < world_size, got rank {self.rank}, world_size {self.world_size}")
        check(self.quarantine_outlier_z >= 0, f"quarantine_outlier_z must be >= 0 (0: off), got {self.quarantine_outlier_z}")
        for name in ("agent", "metrics_address"):
            addr = getattr(self, name)
            check(addr is None or is_address(addr), f"{name} must be 'host:port', got {addr!r}")
        g = self.layer_grouping
        ok = g in ("module", "parameter") or callable(g) or (isinstance(g, int) and g >= 1)
        check(ok, f"layer_grouping must be 'module', 'parameter', an int >= 1 or a callable, got {g!r}")
        ratio = ("lean" if self.update_ratio else "off") if isinstance(self.update_ratio, bool) else self.update_ratio
        check(ratio in UPDATE_RATIO_MODES, f"update_ratio must be one of {UPDATE_RATIO_MODES} (or a bool), got {self.update_ratio!r}")
        object.__setattr__(self, "update_ratio", UpdateRatioMode(ratio))
        check(self.memory_budget_bytes is None or self.memory_budget_bytes >= 0,
               f"memory_budget_bytes must be >= 0, got {self.memory_budget_bytes}")
        check(self.max_overhead is None or self.max_overhead > 0, f"max_overhead must be > 0, got {self.max_overhead}")
        check(self.token_stats in (True, False, "on_spike"),
               f"token_stats must be True, False or 'on_spike', got {self.token_stats!r}")
        if isinstance(self.token_stats, str):
            object.__setattr__(self, "token_stats", TokenStatsMode(self.token_stats))
        check(self.remedy is None or self.remedy in REMEDIES, f"remedy must be None or one of {REMEDIES}, got {self.remedy!r}")
        if self.remedy is not None:
            object.__setattr__(self, "remedy", RemedyAction(self.remedy))
        check(self.remedy != "drop_culprits" or self.token_stats,
               "remedy='drop_culprits' needs token_stats=True (culprits are located from per-token statistics)")
        check(self.history >= 1, f"history must be >= 1, got {self.history}")
        check(self.distributed in ("auto", "off"), f"distributed must be 'auto' or 'off', got {self.distributed!r}")
        object.__setattr__(self, "distributed", DistributedMode(self.distributed))
        check(self.collective_timeout_s > 0, f"collective_timeout_s must be > 0, got {self.collective_timeout_s}")
        check(self.close_timeout_s > 0, f"close_timeout_s must be > 0, got {self.close_timeout_s}")
        check(isinstance(self.detector, DetectorConfig), "detector must be a DetectorConfig")
        check(isinstance(self.localizer, LocalizerConfig), "localizer must be a LocalizerConfig")
        check(isinstance(self.samples, SampleConfig), "samples must be a SampleConfig")
        check(isinstance(self.precursors, PrecursorConfig), "precursors must be a PrecursorConfig")
