from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Tensor(_message.Message):
    __slots__ = ("shape", "dtype", "data")
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    shape: _containers.RepeatedScalarFieldContainer[int]
    dtype: str
    data: bytes
    def __init__(self, shape: _Optional[_Iterable[int]] = ..., dtype: _Optional[str] = ..., data: _Optional[bytes] = ...) -> None: ...

class SequenceDraft(_message.Message):
    __slots__ = ("seq_id", "context_start", "new_token_ids", "new_features", "anchor", "draft_steps", "num_blocks", "temperature", "top_m", "seed", "max_draft_tokens")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_START_FIELD_NUMBER: _ClassVar[int]
    NEW_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    NEW_FEATURES_FIELD_NUMBER: _ClassVar[int]
    ANCHOR_FIELD_NUMBER: _ClassVar[int]
    DRAFT_STEPS_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_M_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    MAX_DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    seq_id: str
    context_start: int
    new_token_ids: _containers.RepeatedScalarFieldContainer[int]
    new_features: Tensor
    anchor: int
    draft_steps: int
    num_blocks: int
    temperature: float
    top_m: int
    seed: int
    max_draft_tokens: int
    def __init__(self, seq_id: _Optional[str] = ..., context_start: _Optional[int] = ..., new_token_ids: _Optional[_Iterable[int]] = ..., new_features: _Optional[_Union[Tensor, _Mapping]] = ..., anchor: _Optional[int] = ..., draft_steps: _Optional[int] = ..., num_blocks: _Optional[int] = ..., temperature: _Optional[float] = ..., top_m: _Optional[int] = ..., seed: _Optional[int] = ..., max_draft_tokens: _Optional[int] = ...) -> None: ...

class DraftRequest(_message.Message):
    __slots__ = ("call_id", "sequences")
    CALL_ID_FIELD_NUMBER: _ClassVar[int]
    SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    call_id: int
    sequences: _containers.RepeatedCompositeFieldContainer[SequenceDraft]
    def __init__(self, call_id: _Optional[int] = ..., sequences: _Optional[_Iterable[_Union[SequenceDraft, _Mapping]]] = ...) -> None: ...

class Block(_message.Message):
    __slots__ = ("seq_id", "tokens", "support_ids", "support_probs", "support_size", "draft_steps", "error", "branches", "parents")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    SUPPORT_IDS_FIELD_NUMBER: _ClassVar[int]
    SUPPORT_PROBS_FIELD_NUMBER: _ClassVar[int]
    SUPPORT_SIZE_FIELD_NUMBER: _ClassVar[int]
    DRAFT_STEPS_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    BRANCHES_FIELD_NUMBER: _ClassVar[int]
    PARENTS_FIELD_NUMBER: _ClassVar[int]
    seq_id: str
    tokens: _containers.RepeatedScalarFieldContainer[int]
    support_ids: _containers.RepeatedScalarFieldContainer[int]
    support_probs: _containers.RepeatedScalarFieldContainer[float]
    support_size: int
    draft_steps: int
    error: str
    branches: _containers.RepeatedCompositeFieldContainer[Branch]
    parents: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, seq_id: _Optional[str] = ..., tokens: _Optional[_Iterable[int]] = ..., support_ids: _Optional[_Iterable[int]] = ..., support_probs: _Optional[_Iterable[float]] = ..., support_size: _Optional[int] = ..., draft_steps: _Optional[int] = ..., error: _Optional[str] = ..., branches: _Optional[_Iterable[_Union[Branch, _Mapping]]] = ..., parents: _Optional[_Iterable[int]] = ...) -> None: ...

class Branch(_message.Message):
    __slots__ = ("tokens", "support_ids", "support_probs", "support_size")
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    SUPPORT_IDS_FIELD_NUMBER: _ClassVar[int]
    SUPPORT_PROBS_FIELD_NUMBER: _ClassVar[int]
    SUPPORT_SIZE_FIELD_NUMBER: _ClassVar[int]
    tokens: _containers.RepeatedScalarFieldContainer[int]
    support_ids: _containers.RepeatedScalarFieldContainer[int]
    support_probs: _containers.RepeatedScalarFieldContainer[float]
    support_size: int
    def __init__(self, tokens: _Optional[_Iterable[int]] = ..., support_ids: _Optional[_Iterable[int]] = ..., support_probs: _Optional[_Iterable[float]] = ..., support_size: _Optional[int] = ...) -> None: ...

class DraftTiming(_message.Message):
    __slots__ = ("queue_s", "forward_s", "batch_size")
    QUEUE_S_FIELD_NUMBER: _ClassVar[int]
    FORWARD_S_FIELD_NUMBER: _ClassVar[int]
    BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    queue_s: float
    forward_s: float
    batch_size: int
    def __init__(self, queue_s: _Optional[float] = ..., forward_s: _Optional[float] = ..., batch_size: _Optional[int] = ...) -> None: ...

class DraftResponse(_message.Message):
    __slots__ = ("call_id", "blocks", "timing")
    CALL_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    TIMING_FIELD_NUMBER: _ClassVar[int]
    call_id: int
    blocks: _containers.RepeatedCompositeFieldContainer[Block]
    timing: DraftTiming
    def __init__(self, call_id: _Optional[int] = ..., blocks: _Optional[_Iterable[_Union[Block, _Mapping]]] = ..., timing: _Optional[_Union[DraftTiming, _Mapping]] = ...) -> None: ...

class GetStepsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class SetStepsRequest(_message.Message):
    __slots__ = ("steps",)
    STEPS_FIELD_NUMBER: _ClassVar[int]
    steps: int
    def __init__(self, steps: _Optional[int] = ...) -> None: ...

class StepsResponse(_message.Message):
    __slots__ = ("steps", "available")
    STEPS_FIELD_NUMBER: _ClassVar[int]
    AVAILABLE_FIELD_NUMBER: _ClassVar[int]
    steps: int
    available: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, steps: _Optional[int] = ..., available: _Optional[_Iterable[int]] = ...) -> None: ...

class ReleaseRequest(_message.Message):
    __slots__ = ("seq_ids",)
    SEQ_IDS_FIELD_NUMBER: _ClassVar[int]
    seq_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, seq_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class ReleaseResponse(_message.Message):
    __slots__ = ("released",)
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    released: int
    def __init__(self, released: _Optional[int] = ...) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StatsResponse(_message.Message):
    __slots__ = ("active_sequences", "context_tokens", "state_bytes", "steps", "drafter", "block_size", "feature_dim")
    ACTIVE_SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STATE_BYTES_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    DRAFTER_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    FEATURE_DIM_FIELD_NUMBER: _ClassVar[int]
    active_sequences: int
    context_tokens: int
    state_bytes: int
    steps: int
    drafter: str
    block_size: int
    feature_dim: int
    def __init__(self, active_sequences: _Optional[int] = ..., context_tokens: _Optional[int] = ..., state_bytes: _Optional[int] = ..., steps: _Optional[int] = ..., drafter: _Optional[str] = ..., block_size: _Optional[int] = ..., feature_dim: _Optional[int] = ...) -> None: ...
