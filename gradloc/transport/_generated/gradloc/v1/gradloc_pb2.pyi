from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class IngestBatch(_message.Message):
    __slots__ = ("schema_version", "client", "drops", "layer_tables", "steps", "incidents", "sequence")
    SCHEMA_VERSION_FIELD_NUMBER: _ClassVar[int]
    CLIENT_FIELD_NUMBER: _ClassVar[int]
    DROPS_FIELD_NUMBER: _ClassVar[int]
    LAYER_TABLES_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    INCIDENTS_FIELD_NUMBER: _ClassVar[int]
    SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    schema_version: int
    client: ClientInfo
    drops: ClientDrops
    layer_tables: _containers.RepeatedCompositeFieldContainer[LayerTable]
    steps: _containers.RepeatedCompositeFieldContainer[Step]
    incidents: _containers.RepeatedCompositeFieldContainer[IncidentMsg]
    sequence: int
    def __init__(self, schema_version: _Optional[int] = ..., client: _Optional[_Union[ClientInfo, _Mapping]] = ..., drops: _Optional[_Union[ClientDrops, _Mapping]] = ..., layer_tables: _Optional[_Iterable[_Union[LayerTable, _Mapping]]] = ..., steps: _Optional[_Iterable[_Union[Step, _Mapping]]] = ..., incidents: _Optional[_Iterable[_Union[IncidentMsg, _Mapping]]] = ..., sequence: _Optional[int] = ...) -> None: ...

class IngestReply(_message.Message):
    __slots__ = ("accepted_steps", "accepted_incidents")
    ACCEPTED_STEPS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_INCIDENTS_FIELD_NUMBER: _ClassVar[int]
    accepted_steps: int
    accepted_incidents: int
    def __init__(self, accepted_steps: _Optional[int] = ..., accepted_incidents: _Optional[int] = ...) -> None: ...

class ClientInfo(_message.Message):
    __slots__ = ("job", "rank", "world_size", "client_id", "hostname", "pid", "gradloc_version")
    JOB_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    CLIENT_ID_FIELD_NUMBER: _ClassVar[int]
    HOSTNAME_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    GRADLOC_VERSION_FIELD_NUMBER: _ClassVar[int]
    job: str
    rank: int
    world_size: int
    client_id: str
    hostname: str
    pid: int
    gradloc_version: str
    def __init__(self, job: _Optional[str] = ..., rank: _Optional[int] = ..., world_size: _Optional[int] = ..., client_id: _Optional[str] = ..., hostname: _Optional[str] = ..., pid: _Optional[int] = ..., gradloc_version: _Optional[str] = ...) -> None: ...

class ClientDrops(_message.Message):
    __slots__ = ("queue_full", "send_failed", "encode_failed", "rejected")
    QUEUE_FULL_FIELD_NUMBER: _ClassVar[int]
    SEND_FAILED_FIELD_NUMBER: _ClassVar[int]
    ENCODE_FAILED_FIELD_NUMBER: _ClassVar[int]
    REJECTED_FIELD_NUMBER: _ClassVar[int]
    queue_full: int
    send_failed: int
    encode_failed: int
    rejected: int
    def __init__(self, queue_full: _Optional[int] = ..., send_failed: _Optional[int] = ..., encode_failed: _Optional[int] = ..., rejected: _Optional[int] = ...) -> None: ...

class LayerTable(_message.Message):
    __slots__ = ("id", "names")
    ID_FIELD_NUMBER: _ClassVar[int]
    NAMES_FIELD_NUMBER: _ClassVar[int]
    id: int
    names: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, id: _Optional[int] = ..., names: _Optional[_Iterable[str]] = ...) -> None: ...

class Step(_message.Message):
    __slots__ = ("job", "rank", "step", "time_unix", "global_norm", "loss", "micro_batches", "nonfinite", "grad_scale", "skipped", "tokens", "layer_table_id", "grad_norm", "grad_max_abs", "layer_nonfinite", "param_norm", "numel", "update_ratio", "overhead_seconds", "step_seconds", "overhead", "shed", "rl", "layers_global", "norm_mean", "norm_threshold", "samples", "events", "groups", "precursors", "precursor_findings")
    class EventsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    JOB_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    TIME_UNIX_FIELD_NUMBER: _ClassVar[int]
    GLOBAL_NORM_FIELD_NUMBER: _ClassVar[int]
    LOSS_FIELD_NUMBER: _ClassVar[int]
    MICRO_BATCHES_FIELD_NUMBER: _ClassVar[int]
    NONFINITE_FIELD_NUMBER: _ClassVar[int]
    GRAD_SCALE_FIELD_NUMBER: _ClassVar[int]
    SKIPPED_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    LAYER_TABLE_ID_FIELD_NUMBER: _ClassVar[int]
    GRAD_NORM_FIELD_NUMBER: _ClassVar[int]
    GRAD_MAX_ABS_FIELD_NUMBER: _ClassVar[int]
    LAYER_NONFINITE_FIELD_NUMBER: _ClassVar[int]
    PARAM_NORM_FIELD_NUMBER: _ClassVar[int]
    NUMEL_FIELD_NUMBER: _ClassVar[int]
    UPDATE_RATIO_FIELD_NUMBER: _ClassVar[int]
    OVERHEAD_SECONDS_FIELD_NUMBER: _ClassVar[int]
    STEP_SECONDS_FIELD_NUMBER: _ClassVar[int]
    OVERHEAD_FIELD_NUMBER: _ClassVar[int]
    SHED_FIELD_NUMBER: _ClassVar[int]
    RL_FIELD_NUMBER: _ClassVar[int]
    LAYERS_GLOBAL_FIELD_NUMBER: _ClassVar[int]
    NORM_MEAN_FIELD_NUMBER: _ClassVar[int]
    NORM_THRESHOLD_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_FIELD_NUMBER: _ClassVar[int]
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    GROUPS_FIELD_NUMBER: _ClassVar[int]
    PRECURSORS_FIELD_NUMBER: _ClassVar[int]
    PRECURSOR_FINDINGS_FIELD_NUMBER: _ClassVar[int]
    job: str
    rank: int
    step: int
    time_unix: float
    global_norm: float
    loss: float
    micro_batches: int
    nonfinite: int
    grad_scale: float
    skipped: bool
    tokens: TokenStatsMsg
    layer_table_id: int
    grad_norm: _containers.RepeatedScalarFieldContainer[float]
    grad_max_abs: _containers.RepeatedScalarFieldContainer[float]
    layer_nonfinite: _containers.RepeatedScalarFieldContainer[int]
    param_norm: _containers.RepeatedScalarFieldContainer[float]
    numel: _containers.RepeatedScalarFieldContainer[int]
    update_ratio: _containers.RepeatedScalarFieldContainer[float]
    overhead_seconds: float
    step_seconds: float
    overhead: float
    shed: _containers.RepeatedScalarFieldContainer[str]
    rl: RLStatsMsg
    layers_global: bool
    norm_mean: float
    norm_threshold: float
    samples: SampleStatsMsg
    events: _containers.ScalarMap[str, int]
    groups: _containers.RepeatedCompositeFieldContainer[GroupTokensMsg]
    precursors: _containers.RepeatedCompositeFieldContainer[PrecursorMsg]
    precursor_findings: _containers.RepeatedCompositeFieldContainer[PrecursorFindingMsg]
    def __init__(self, job: _Optional[str] = ..., rank: _Optional[int] = ..., step: _Optional[int] = ..., time_unix: _Optional[float] = ..., global_norm: _Optional[float] = ..., loss: _Optional[float] = ..., micro_batches: _Optional[int] = ..., nonfinite: _Optional[int] = ..., grad_scale: _Optional[float] = ..., skipped: _Optional[bool] = ..., tokens: _Optional[_Union[TokenStatsMsg, _Mapping]] = ..., layer_table_id: _Optional[int] = ..., grad_norm: _Optional[_Iterable[float]] = ..., grad_max_abs: _Optional[_Iterable[float]] = ..., layer_nonfinite: _Optional[_Iterable[int]] = ..., param_norm: _Optional[_Iterable[float]] = ..., numel: _Optional[_Iterable[int]] = ..., update_ratio: _Optional[_Iterable[float]] = ..., overhead_seconds: _Optional[float] = ..., step_seconds: _Optional[float] = ..., overhead: _Optional[float] = ..., shed: _Optional[_Iterable[str]] = ..., rl: _Optional[_Union[RLStatsMsg, _Mapping]] = ..., layers_global: _Optional[bool] = ..., norm_mean: _Optional[float] = ..., norm_threshold: _Optional[float] = ..., samples: _Optional[_Union[SampleStatsMsg, _Mapping]] = ..., events: _Optional[_Mapping[str, int]] = ..., groups: _Optional[_Iterable[_Union[GroupTokensMsg, _Mapping]]] = ..., precursors: _Optional[_Iterable[_Union[PrecursorMsg, _Mapping]]] = ..., precursor_findings: _Optional[_Iterable[_Union[PrecursorFindingMsg, _Mapping]]] = ...) -> None: ...

class PrecursorFindingMsg(_message.Message):
    __slots__ = ("statistic", "layer", "head", "trend", "value", "baseline", "z", "change", "rate", "since_step", "pages", "drivers", "detail")
    STATISTIC_FIELD_NUMBER: _ClassVar[int]
    LAYER_FIELD_NUMBER: _ClassVar[int]
    HEAD_FIELD_NUMBER: _ClassVar[int]
    TREND_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    BASELINE_FIELD_NUMBER: _ClassVar[int]
    Z_FIELD_NUMBER: _ClassVar[int]
    CHANGE_FIELD_NUMBER: _ClassVar[int]
    RATE_FIELD_NUMBER: _ClassVar[int]
    SINCE_STEP_FIELD_NUMBER: _ClassVar[int]
    PAGES_FIELD_NUMBER: _ClassVar[int]
    DRIVERS_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    statistic: str
    layer: str
    head: int
    trend: str
    value: float
    baseline: float
    z: float
    change: float
    rate: float
    since_step: int
    pages: bool
    drivers: _containers.RepeatedCompositeFieldContainer[PrecursorDriverMsg]
    detail: str
    def __init__(self, statistic: _Optional[str] = ..., layer: _Optional[str] = ..., head: _Optional[int] = ..., trend: _Optional[str] = ..., value: _Optional[float] = ..., baseline: _Optional[float] = ..., z: _Optional[float] = ..., change: _Optional[float] = ..., rate: _Optional[float] = ..., since_step: _Optional[int] = ..., pages: _Optional[bool] = ..., drivers: _Optional[_Iterable[_Union[PrecursorDriverMsg, _Mapping]]] = ..., detail: _Optional[str] = ...) -> None: ...

class PrecursorDriverMsg(_message.Message):
    __slots__ = ("step", "value", "micro_batch", "sample", "position", "sample_id", "sample_info", "rank")
    STEP_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    MICRO_BATCH_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_FIELD_NUMBER: _ClassVar[int]
    POSITION_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_ID_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_INFO_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    step: int
    value: float
    micro_batch: int
    sample: int
    position: int
    sample_id: str
    sample_info: SampleInfoMsg
    rank: int
    def __init__(self, step: _Optional[int] = ..., value: _Optional[float] = ..., micro_batch: _Optional[int] = ..., sample: _Optional[int] = ..., position: _Optional[int] = ..., sample_id: _Optional[str] = ..., sample_info: _Optional[_Union[SampleInfoMsg, _Mapping]] = ..., rank: _Optional[int] = ...) -> None: ...

class PrecursorMsg(_message.Message):
    __slots__ = ("kind", "layer", "value", "head", "at", "rank")
    KIND_FIELD_NUMBER: _ClassVar[int]
    LAYER_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    HEAD_FIELD_NUMBER: _ClassVar[int]
    AT_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    kind: str
    layer: str
    value: float
    head: int
    at: _containers.RepeatedScalarFieldContainer[int]
    rank: int
    def __init__(self, kind: _Optional[str] = ..., layer: _Optional[str] = ..., value: _Optional[float] = ..., head: _Optional[int] = ..., at: _Optional[_Iterable[int]] = ..., rank: _Optional[int] = ...) -> None: ...

class GroupTokensMsg(_message.Message):
    __slots__ = ("kind", "name", "samples", "tokens")
    KIND_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    kind: str
    name: str
    samples: int
    tokens: int
    def __init__(self, kind: _Optional[str] = ..., name: _Optional[str] = ..., samples: _Optional[int] = ..., tokens: _Optional[int] = ...) -> None: ...

class SampleStatsMsg(_message.Message):
    __slots__ = ("judged", "unjudged", "nonfinite", "z_counts", "z_sum", "max_z", "baseline", "flagged", "outliers", "rl_mismatch_baseline", "rl_mismatch_streak")
    JUDGED_FIELD_NUMBER: _ClassVar[int]
    UNJUDGED_FIELD_NUMBER: _ClassVar[int]
    NONFINITE_FIELD_NUMBER: _ClassVar[int]
    Z_COUNTS_FIELD_NUMBER: _ClassVar[int]
    Z_SUM_FIELD_NUMBER: _ClassVar[int]
    MAX_Z_FIELD_NUMBER: _ClassVar[int]
    BASELINE_FIELD_NUMBER: _ClassVar[int]
    FLAGGED_FIELD_NUMBER: _ClassVar[int]
    OUTLIERS_FIELD_NUMBER: _ClassVar[int]
    RL_MISMATCH_BASELINE_FIELD_NUMBER: _ClassVar[int]
    RL_MISMATCH_STREAK_FIELD_NUMBER: _ClassVar[int]
    judged: int
    unjudged: int
    nonfinite: int
    z_counts: _containers.RepeatedScalarFieldContainer[int]
    z_sum: float
    max_z: float
    baseline: float
    flagged: int
    outliers: _containers.RepeatedCompositeFieldContainer[SampleOutlierMsg]
    rl_mismatch_baseline: float
    rl_mismatch_streak: int
    def __init__(self, judged: _Optional[int] = ..., unjudged: _Optional[int] = ..., nonfinite: _Optional[int] = ..., z_counts: _Optional[_Iterable[int]] = ..., z_sum: _Optional[float] = ..., max_z: _Optional[float] = ..., baseline: _Optional[float] = ..., flagged: _Optional[int] = ..., outliers: _Optional[_Iterable[_Union[SampleOutlierMsg, _Mapping]]] = ..., rl_mismatch_baseline: _Optional[float] = ..., rl_mismatch_streak: _Optional[int] = ...) -> None: ...

class SampleOutlierMsg(_message.Message):
    __slots__ = ("kind", "score", "z", "baseline", "micro_batch", "sample", "sample_id", "start", "end", "tokens", "text", "detail", "sample_info")
    KIND_FIELD_NUMBER: _ClassVar[int]
    SCORE_FIELD_NUMBER: _ClassVar[int]
    Z_FIELD_NUMBER: _ClassVar[int]
    BASELINE_FIELD_NUMBER: _ClassVar[int]
    MICRO_BATCH_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_ID_FIELD_NUMBER: _ClassVar[int]
    START_FIELD_NUMBER: _ClassVar[int]
    END_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_INFO_FIELD_NUMBER: _ClassVar[int]
    kind: str
    score: float
    z: float
    baseline: float
    micro_batch: int
    sample: int
    sample_id: str
    start: int
    end: int
    tokens: int
    text: str
    detail: str
    sample_info: SampleInfoMsg
    def __init__(self, kind: _Optional[str] = ..., score: _Optional[float] = ..., z: _Optional[float] = ..., baseline: _Optional[float] = ..., micro_batch: _Optional[int] = ..., sample: _Optional[int] = ..., sample_id: _Optional[str] = ..., start: _Optional[int] = ..., end: _Optional[int] = ..., tokens: _Optional[int] = ..., text: _Optional[str] = ..., detail: _Optional[str] = ..., sample_info: _Optional[_Union[SampleInfoMsg, _Mapping]] = ...) -> None: ...

class RLStatsMsg(_message.Message):
    __slots__ = ("tokens", "log_ratio_counts", "log_ratio_sum", "max_abs_log_ratio", "mismatch_fraction", "max_abs_log_ratio_old", "clip_fraction", "advantage_counts", "advantage_rms", "max_abs_advantage", "entropy_mean", "advantage_sum", "kl_rollout", "job_entropy_mean", "job_kl_rollout")
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    LOG_RATIO_COUNTS_FIELD_NUMBER: _ClassVar[int]
    LOG_RATIO_SUM_FIELD_NUMBER: _ClassVar[int]
    MAX_ABS_LOG_RATIO_FIELD_NUMBER: _ClassVar[int]
    MISMATCH_FRACTION_FIELD_NUMBER: _ClassVar[int]
    MAX_ABS_LOG_RATIO_OLD_FIELD_NUMBER: _ClassVar[int]
    CLIP_FRACTION_FIELD_NUMBER: _ClassVar[int]
    ADVANTAGE_COUNTS_FIELD_NUMBER: _ClassVar[int]
    ADVANTAGE_RMS_FIELD_NUMBER: _ClassVar[int]
    MAX_ABS_ADVANTAGE_FIELD_NUMBER: _ClassVar[int]
    ENTROPY_MEAN_FIELD_NUMBER: _ClassVar[int]
    ADVANTAGE_SUM_FIELD_NUMBER: _ClassVar[int]
    KL_ROLLOUT_FIELD_NUMBER: _ClassVar[int]
    JOB_ENTROPY_MEAN_FIELD_NUMBER: _ClassVar[int]
    JOB_KL_ROLLOUT_FIELD_NUMBER: _ClassVar[int]
    tokens: int
    log_ratio_counts: _containers.RepeatedScalarFieldContainer[int]
    log_ratio_sum: float
    max_abs_log_ratio: float
    mismatch_fraction: float
    max_abs_log_ratio_old: float
    clip_fraction: float
    advantage_counts: _containers.RepeatedScalarFieldContainer[int]
    advantage_rms: float
    max_abs_advantage: float
    entropy_mean: float
    advantage_sum: float
    kl_rollout: float
    job_entropy_mean: float
    job_kl_rollout: float
    def __init__(self, tokens: _Optional[int] = ..., log_ratio_counts: _Optional[_Iterable[int]] = ..., log_ratio_sum: _Optional[float] = ..., max_abs_log_ratio: _Optional[float] = ..., mismatch_fraction: _Optional[float] = ..., max_abs_log_ratio_old: _Optional[float] = ..., clip_fraction: _Optional[float] = ..., advantage_counts: _Optional[_Iterable[int]] = ..., advantage_rms: _Optional[float] = ..., max_abs_advantage: _Optional[float] = ..., entropy_mean: _Optional[float] = ..., advantage_sum: _Optional[float] = ..., kl_rollout: _Optional[float] = ..., job_entropy_mean: _Optional[float] = ..., job_kl_rollout: _Optional[float] = ...) -> None: ...

class TokenStatsMsg(_message.Message):
    __slots__ = ("tokens", "total_score", "top_share", "micro_batch_shares", "unattributed_share", "dropped_calls", "micro_batch", "sample", "position", "score", "share", "token_id", "sample_id", "sample_id_none", "layer_count", "layer_index", "layer_share", "extra_layers")
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_SCORE_FIELD_NUMBER: _ClassVar[int]
    TOP_SHARE_FIELD_NUMBER: _ClassVar[int]
    MICRO_BATCH_SHARES_FIELD_NUMBER: _ClassVar[int]
    UNATTRIBUTED_SHARE_FIELD_NUMBER: _ClassVar[int]
    DROPPED_CALLS_FIELD_NUMBER: _ClassVar[int]
    MICRO_BATCH_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_FIELD_NUMBER: _ClassVar[int]
    POSITION_FIELD_NUMBER: _ClassVar[int]
    SCORE_FIELD_NUMBER: _ClassVar[int]
    SHARE_FIELD_NUMBER: _ClassVar[int]
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_ID_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_ID_NONE_FIELD_NUMBER: _ClassVar[int]
    LAYER_COUNT_FIELD_NUMBER: _ClassVar[int]
    LAYER_INDEX_FIELD_NUMBER: _ClassVar[int]
    LAYER_SHARE_FIELD_NUMBER: _ClassVar[int]
    EXTRA_LAYERS_FIELD_NUMBER: _ClassVar[int]
    tokens: int
    total_score: float
    top_share: float
    micro_batch_shares: _containers.RepeatedScalarFieldContainer[float]
    unattributed_share: float
    dropped_calls: int
    micro_batch: _containers.RepeatedScalarFieldContainer[int]
    sample: _containers.RepeatedScalarFieldContainer[int]
    position: _containers.RepeatedScalarFieldContainer[int]
    score: _containers.RepeatedScalarFieldContainer[float]
    share: _containers.RepeatedScalarFieldContainer[float]
    token_id: _containers.RepeatedScalarFieldContainer[int]
    sample_id: _containers.RepeatedScalarFieldContainer[str]
    sample_id_none: _containers.RepeatedScalarFieldContainer[int]
    layer_count: _containers.RepeatedScalarFieldContainer[int]
    layer_index: _containers.RepeatedScalarFieldContainer[int]
    layer_share: _containers.RepeatedScalarFieldContainer[float]
    extra_layers: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, tokens: _Optional[int] = ..., total_score: _Optional[float] = ..., top_share: _Optional[float] = ..., micro_batch_shares: _Optional[_Iterable[float]] = ..., unattributed_share: _Optional[float] = ..., dropped_calls: _Optional[int] = ..., micro_batch: _Optional[_Iterable[int]] = ..., sample: _Optional[_Iterable[int]] = ..., position: _Optional[_Iterable[int]] = ..., score: _Optional[_Iterable[float]] = ..., share: _Optional[_Iterable[float]] = ..., token_id: _Optional[_Iterable[int]] = ..., sample_id: _Optional[_Iterable[str]] = ..., sample_id_none: _Optional[_Iterable[int]] = ..., layer_count: _Optional[_Iterable[int]] = ..., layer_index: _Optional[_Iterable[int]] = ..., layer_share: _Optional[_Iterable[float]] = ..., extra_layers: _Optional[_Iterable[str]] = ...) -> None: ...

class LayerShareMsg(_message.Message):
    __slots__ = ("layer", "share")
    LAYER_FIELD_NUMBER: _ClassVar[int]
    SHARE_FIELD_NUMBER: _ClassVar[int]
    layer: str
    share: float
    def __init__(self, layer: _Optional[str] = ..., share: _Optional[float] = ...) -> None: ...

class LayerStatsMsg(_message.Message):
    __slots__ = ("layer", "grad_norm", "grad_max_abs", "nonfinite", "param_norm", "numel", "update_ratio", "z")
    LAYER_FIELD_NUMBER: _ClassVar[int]
    GRAD_NORM_FIELD_NUMBER: _ClassVar[int]
    GRAD_MAX_ABS_FIELD_NUMBER: _ClassVar[int]
    NONFINITE_FIELD_NUMBER: _ClassVar[int]
    PARAM_NORM_FIELD_NUMBER: _ClassVar[int]
    NUMEL_FIELD_NUMBER: _ClassVar[int]
    UPDATE_RATIO_FIELD_NUMBER: _ClassVar[int]
    Z_FIELD_NUMBER: _ClassVar[int]
    layer: str
    grad_norm: float
    grad_max_abs: float
    nonfinite: int
    param_norm: float
    numel: int
    update_ratio: float
    z: float
    def __init__(self, layer: _Optional[str] = ..., grad_norm: _Optional[float] = ..., grad_max_abs: _Optional[float] = ..., nonfinite: _Optional[int] = ..., param_norm: _Optional[float] = ..., numel: _Optional[int] = ..., update_ratio: _Optional[float] = ..., z: _Optional[float] = ...) -> None: ...

class SpikeMsg(_message.Message):
    __slots__ = ("step", "kinds", "global_norm", "z", "mean", "std", "loss", "loss_z", "loss_mean", "layers", "detail", "follows", "last_healthy_step")
    STEP_FIELD_NUMBER: _ClassVar[int]
    KINDS_FIELD_NUMBER: _ClassVar[int]
    GLOBAL_NORM_FIELD_NUMBER: _ClassVar[int]
    Z_FIELD_NUMBER: _ClassVar[int]
    MEAN_FIELD_NUMBER: _ClassVar[int]
    STD_FIELD_NUMBER: _ClassVar[int]
    LOSS_FIELD_NUMBER: _ClassVar[int]
    LOSS_Z_FIELD_NUMBER: _ClassVar[int]
    LOSS_MEAN_FIELD_NUMBER: _ClassVar[int]
    LAYERS_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    FOLLOWS_FIELD_NUMBER: _ClassVar[int]
    LAST_HEALTHY_STEP_FIELD_NUMBER: _ClassVar[int]
    step: int
    kinds: _containers.RepeatedScalarFieldContainer[str]
    global_norm: float
    z: float
    mean: float
    std: float
    loss: float
    loss_z: float
    loss_mean: float
    layers: _containers.RepeatedScalarFieldContainer[str]
    detail: str
    follows: int
    last_healthy_step: int
    def __init__(self, step: _Optional[int] = ..., kinds: _Optional[_Iterable[str]] = ..., global_norm: _Optional[float] = ..., z: _Optional[float] = ..., mean: _Optional[float] = ..., std: _Optional[float] = ..., loss: _Optional[float] = ..., loss_z: _Optional[float] = ..., loss_mean: _Optional[float] = ..., layers: _Optional[_Iterable[str]] = ..., detail: _Optional[str] = ..., follows: _Optional[int] = ..., last_healthy_step: _Optional[int] = ...) -> None: ...

class CulpritMsg(_message.Message):
    __slots__ = ("micro_batch", "sample", "position", "share", "score_share", "token_id", "text", "sample_id", "layers", "rl", "classification", "sample_info", "rank")
    MICRO_BATCH_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_FIELD_NUMBER: _ClassVar[int]
    POSITION_FIELD_NUMBER: _ClassVar[int]
    SHARE_FIELD_NUMBER: _ClassVar[int]
    SCORE_SHARE_FIELD_NUMBER: _ClassVar[int]
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_ID_FIELD_NUMBER: _ClassVar[int]
    LAYERS_FIELD_NUMBER: _ClassVar[int]
    RL_FIELD_NUMBER: _ClassVar[int]
    CLASSIFICATION_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_INFO_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    micro_batch: int
    sample: int
    position: int
    share: float
    score_share: float
    token_id: int
    text: str
    sample_id: str
    layers: _containers.RepeatedCompositeFieldContainer[LayerShareMsg]
    rl: TokenRLMsg
    classification: ClassificationMsg
    sample_info: SampleInfoMsg
    rank: int
    def __init__(self, micro_batch: _Optional[int] = ..., sample: _Optional[int] = ..., position: _Optional[int] = ..., share: _Optional[float] = ..., score_share: _Optional[float] = ..., token_id: _Optional[int] = ..., text: _Optional[str] = ..., sample_id: _Optional[str] = ..., layers: _Optional[_Iterable[_Union[LayerShareMsg, _Mapping]]] = ..., rl: _Optional[_Union[TokenRLMsg, _Mapping]] = ..., classification: _Optional[_Union[ClassificationMsg, _Mapping]] = ..., sample_info: _Optional[_Union[SampleInfoMsg, _Mapping]] = ..., rank: _Optional[int] = ...) -> None: ...

class TokenRLMsg(_message.Message):
    __slots__ = ("logp", "rollout_logp", "old_logp", "advantage", "ratio", "clipped", "entropy", "sequence_log_ratio")
    LOGP_FIELD_NUMBER: _ClassVar[int]
    ROLLOUT_LOGP_FIELD_NUMBER: _ClassVar[int]
    OLD_LOGP_FIELD_NUMBER: _ClassVar[int]
    ADVANTAGE_FIELD_NUMBER: _ClassVar[int]
    RATIO_FIELD_NUMBER: _ClassVar[int]
    CLIPPED_FIELD_NUMBER: _ClassVar[int]
    ENTROPY_FIELD_NUMBER: _ClassVar[int]
    SEQUENCE_LOG_RATIO_FIELD_NUMBER: _ClassVar[int]
    logp: float
    rollout_logp: float
    old_logp: float
    advantage: float
    ratio: float
    clipped: bool
    entropy: float
    sequence_log_ratio: float
    def __init__(self, logp: _Optional[float] = ..., rollout_logp: _Optional[float] = ..., old_logp: _Optional[float] = ..., advantage: _Optional[float] = ..., ratio: _Optional[float] = ..., clipped: _Optional[bool] = ..., entropy: _Optional[float] = ..., sequence_log_ratio: _Optional[float] = ...) -> None: ...

class EvidenceMsg(_message.Message):
    __slots__ = ("name", "value")
    NAME_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    name: str
    value: float
    def __init__(self, name: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...

class ClassificationMsg(_message.Message):
    __slots__ = ("kind", "reason", "evidence")
    KIND_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    EVIDENCE_FIELD_NUMBER: _ClassVar[int]
    kind: str
    reason: str
    evidence: _containers.RepeatedCompositeFieldContainer[EvidenceMsg]
    def __init__(self, kind: _Optional[str] = ..., reason: _Optional[str] = ..., evidence: _Optional[_Iterable[_Union[EvidenceMsg, _Mapping]]] = ...) -> None: ...

class SampleInfoMsg(_message.Message):
    __slots__ = ("request_id", "completion_index", "prompt_tokens", "response_start", "response_tokens", "finish_reason", "source", "origin", "tags")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_INDEX_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    RESPONSE_START_FIELD_NUMBER: _ClassVar[int]
    RESPONSE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    ORIGIN_FIELD_NUMBER: _ClassVar[int]
    TAGS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    completion_index: int
    prompt_tokens: int
    response_start: int
    response_tokens: int
    finish_reason: str
    source: str
    origin: str
    tags: _containers.RepeatedCompositeFieldContainer[SampleTagMsg]
    def __init__(self, request_id: _Optional[str] = ..., completion_index: _Optional[int] = ..., prompt_tokens: _Optional[int] = ..., response_start: _Optional[int] = ..., response_tokens: _Optional[int] = ..., finish_reason: _Optional[str] = ..., source: _Optional[str] = ..., origin: _Optional[str] = ..., tags: _Optional[_Iterable[_Union[SampleTagMsg, _Mapping]]] = ...) -> None: ...

class SampleTagMsg(_message.Message):
    __slots__ = ("key", "value")
    KEY_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    key: str
    value: str
    def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...

class CulpritSpanMsg(_message.Message):
    __slots__ = ("micro_batch", "sample", "start", "end", "share", "token_ids", "text", "context_before", "context_after", "sample_id", "sample_info", "rank", "window_start", "window_tokens", "window_scores")
    MICRO_BATCH_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_FIELD_NUMBER: _ClassVar[int]
    START_FIELD_NUMBER: _ClassVar[int]
    END_FIELD_NUMBER: _ClassVar[int]
    SHARE_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_BEFORE_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_AFTER_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_ID_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_INFO_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    WINDOW_START_FIELD_NUMBER: _ClassVar[int]
    WINDOW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    WINDOW_SCORES_FIELD_NUMBER: _ClassVar[int]
    micro_batch: int
    sample: int
    start: int
    end: int
    share: float
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    text: str
    context_before: str
    context_after: str
    sample_id: str
    sample_info: SampleInfoMsg
    rank: int
    window_start: int
    window_tokens: _containers.RepeatedScalarFieldContainer[str]
    window_scores: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, micro_batch: _Optional[int] = ..., sample: _Optional[int] = ..., start: _Optional[int] = ..., end: _Optional[int] = ..., share: _Optional[float] = ..., token_ids: _Optional[_Iterable[int]] = ..., text: _Optional[str] = ..., context_before: _Optional[str] = ..., context_after: _Optional[str] = ..., sample_id: _Optional[str] = ..., sample_info: _Optional[_Union[SampleInfoMsg, _Mapping]] = ..., rank: _Optional[int] = ..., window_start: _Optional[int] = ..., window_tokens: _Optional[_Iterable[str]] = ..., window_scores: _Optional[_Iterable[float]] = ...) -> None: ...

class LocalizationMsg(_message.Message):
    __slots__ = ("step", "method", "status", "probes", "explained_share", "global_norm", "culprit_norm", "norm_without_culprits", "culprits", "spans", "micro_batch_shares", "unattributed_share", "loss_share", "loss_without_culprits", "note", "samples", "level", "passes", "groups")
    STEP_FIELD_NUMBER: _ClassVar[int]
    METHOD_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    PROBES_FIELD_NUMBER: _ClassVar[int]
    EXPLAINED_SHARE_FIELD_NUMBER: _ClassVar[int]
    GLOBAL_NORM_FIELD_NUMBER: _ClassVar[int]
    CULPRIT_NORM_FIELD_NUMBER: _ClassVar[int]
    NORM_WITHOUT_CULPRITS_FIELD_NUMBER: _ClassVar[int]
    CULPRITS_FIELD_NUMBER: _ClassVar[int]
    SPANS_FIELD_NUMBER: _ClassVar[int]
    MICRO_BATCH_SHARES_FIELD_NUMBER: _ClassVar[int]
    UNATTRIBUTED_SHARE_FIELD_NUMBER: _ClassVar[int]
    LOSS_SHARE_FIELD_NUMBER: _ClassVar[int]
    LOSS_WITHOUT_CULPRITS_FIELD_NUMBER: _ClassVar[int]
    NOTE_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_FIELD_NUMBER: _ClassVar[int]
    LEVEL_FIELD_NUMBER: _ClassVar[int]
    PASSES_FIELD_NUMBER: _ClassVar[int]
    GROUPS_FIELD_NUMBER: _ClassVar[int]
    step: int
    method: str
    status: str
    probes: int
    explained_share: float
    global_norm: float
    culprit_norm: float
    norm_without_culprits: float
    culprits: _containers.RepeatedCompositeFieldContainer[CulpritMsg]
    spans: _containers.RepeatedCompositeFieldContainer[CulpritSpanMsg]
    micro_batch_shares: _containers.RepeatedScalarFieldContainer[float]
    unattributed_share: float
    loss_share: float
    loss_without_culprits: float
    note: str
    samples: _containers.RepeatedCompositeFieldContainer[SampleShareMsg]
    level: str
    passes: int
    groups: _containers.RepeatedCompositeFieldContainer[CulpritGroupMsg]
    def __init__(self, step: _Optional[int] = ..., method: _Optional[str] = ..., status: _Optional[str] = ..., probes: _Optional[int] = ..., explained_share: _Optional[float] = ..., global_norm: _Optional[float] = ..., culprit_norm: _Optional[float] = ..., norm_without_culprits: _Optional[float] = ..., culprits: _Optional[_Iterable[_Union[CulpritMsg, _Mapping]]] = ..., spans: _Optional[_Iterable[_Union[CulpritSpanMsg, _Mapping]]] = ..., micro_batch_shares: _Optional[_Iterable[float]] = ..., unattributed_share: _Optional[float] = ..., loss_share: _Optional[float] = ..., loss_without_culprits: _Optional[float] = ..., note: _Optional[str] = ..., samples: _Optional[_Iterable[_Union[SampleShareMsg, _Mapping]]] = ..., level: _Optional[str] = ..., passes: _Optional[int] = ..., groups: _Optional[_Iterable[_Union[CulpritGroupMsg, _Mapping]]] = ...) -> None: ...

class CulpritGroupMsg(_message.Message):
    __slots__ = ("share", "micro_batch", "rank", "micro_batches", "samples", "tokens")
    SHARE_FIELD_NUMBER: _ClassVar[int]
    MICRO_BATCH_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    MICRO_BATCHES_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    share: float
    micro_batch: int
    rank: int
    micro_batches: int
    samples: int
    tokens: int
    def __init__(self, share: _Optional[float] = ..., micro_batch: _Optional[int] = ..., rank: _Optional[int] = ..., micro_batches: _Optional[int] = ..., samples: _Optional[int] = ..., tokens: _Optional[int] = ...) -> None: ...

class SampleShareMsg(_message.Message):
    __slots__ = ("micro_batch", "sample", "score_share", "share", "sample_id", "tokens", "rank")
    MICRO_BATCH_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_FIELD_NUMBER: _ClassVar[int]
    SCORE_SHARE_FIELD_NUMBER: _ClassVar[int]
    SHARE_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_ID_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    micro_batch: int
    sample: int
    score_share: float
    share: float
    sample_id: str
    tokens: int
    rank: int
    def __init__(self, micro_batch: _Optional[int] = ..., sample: _Optional[int] = ..., score_share: _Optional[float] = ..., share: _Optional[float] = ..., sample_id: _Optional[str] = ..., tokens: _Optional[int] = ..., rank: _Optional[int] = ...) -> None: ...

class RemedyMsg(_message.Message):
    __slots__ = ("action", "applied", "norm_before", "norm_after", "reason")
    ACTION_FIELD_NUMBER: _ClassVar[int]
    APPLIED_FIELD_NUMBER: _ClassVar[int]
    NORM_BEFORE_FIELD_NUMBER: _ClassVar[int]
    NORM_AFTER_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    action: str
    applied: bool
    norm_before: float
    norm_after: float
    reason: str
    def __init__(self, action: _Optional[str] = ..., applied: _Optional[bool] = ..., norm_before: _Optional[float] = ..., norm_after: _Optional[float] = ..., reason: _Optional[str] = ...) -> None: ...

class IncidentMsg(_message.Message):
    __slots__ = ("incident_id", "job", "rank", "step", "time_unix", "spike", "localization", "schema_version", "top_layers", "remedy", "classification", "scope")
    INCIDENT_ID_FIELD_NUMBER: _ClassVar[int]
    JOB_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    TIME_UNIX_FIELD_NUMBER: _ClassVar[int]
    SPIKE_FIELD_NUMBER: _ClassVar[int]
    LOCALIZATION_FIELD_NUMBER: _ClassVar[int]
    SCHEMA_VERSION_FIELD_NUMBER: _ClassVar[int]
    TOP_LAYERS_FIELD_NUMBER: _ClassVar[int]
    REMEDY_FIELD_NUMBER: _ClassVar[int]
    CLASSIFICATION_FIELD_NUMBER: _ClassVar[int]
    SCOPE_FIELD_NUMBER: _ClassVar[int]
    incident_id: str
    job: str
    rank: int
    step: int
    time_unix: float
    spike: SpikeMsg
    localization: LocalizationMsg
    schema_version: int
    top_layers: _containers.RepeatedCompositeFieldContainer[LayerStatsMsg]
    remedy: RemedyMsg
    classification: ClassificationMsg
    scope: str
    def __init__(self, incident_id: _Optional[str] = ..., job: _Optional[str] = ..., rank: _Optional[int] = ..., step: _Optional[int] = ..., time_unix: _Optional[float] = ..., spike: _Optional[_Union[SpikeMsg, _Mapping]] = ..., localization: _Optional[_Union[LocalizationMsg, _Mapping]] = ..., schema_version: _Optional[int] = ..., top_layers: _Optional[_Iterable[_Union[LayerStatsMsg, _Mapping]]] = ..., remedy: _Optional[_Union[RemedyMsg, _Mapping]] = ..., classification: _Optional[_Union[ClassificationMsg, _Mapping]] = ..., scope: _Optional[str] = ...) -> None: ...
