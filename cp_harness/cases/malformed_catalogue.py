"""The catalogue of malformed inputs, as data: every documented function, every way its input can be wrong.

Each entry names the function under test, a *base* input (a valid call built deterministically on every
rank by ``cp_harness.cases.malformed_inputs``), the *mutations* that break it, the acceptable exception
types, and the field names of which the message must name one. The mutation operations and the contract
every entry is held to are described in ``cp_harness.cases.malformed_inputs``.
"""

from __future__ import annotations

import dataclasses
import zlib

BOTH = ("ValueError", "TypeError")


@dataclasses.dataclass(frozen=True)
class Malformed:
    """One malformed input: ``function`` called on ``base`` after ``mutations`` (see the module docstring)."""

    name: str
    function: str
    base: str
    mutations: tuple[dict, ...]
    fields: tuple[str, ...]
    why: str
    errors: tuple[str, ...] = ("ValueError",)
    min_world_size: int = 1
    world_size: int | None = None  # fixed size (e.g. the 2 x 2 mesh); else chosen by the suite

    def description(self, world_size: int, *, control: bool = False, seed: int | None = None) -> dict:
        """The case keys of this entry at ``world_size`` (``cp_harness.checks.malformed.case_for`` adds the check)."""
        keys = {
            "world_size": int(world_size),
            "name": self.name,
            "function": self.function,
            "base": self.base,
            "mutations": [dict(m) for m in self.mutations],
            "errors": list(self.errors),
            "fields": list(self.fields),
            "why": self.why,
            "seed": zlib.crc32(self.name.encode()) % 1000 if seed is None else seed,
        }
        if control:
            keys["control"] = True
        return keys


def _set(key, index, value, **kw):
    return {"op": "set", "key": key, "index": list(index), "value": value, **kw}


def _assign(key, value, **kw):
    return {"op": "assign", "key": key, "value": value, **kw}


def _op(op, key=None, **kw):
    out = {"op": op, **kw}
    if key is not None:
        out["key"] = key
    return out


SL, SLP = "batch.seq_lens", "batch.seq_lens_padded"
UNPACK, INK_PREP, VALIDATE = (
    "inkling2.unpack_row_layout",
    "inkling2.prepare_cp_inputs",
    "inkling2.validate_document_positions",
)
GATHER_SEQ, HISTORY = "inkling2.gather_sequence", "inkling2.convolution_history"
M4_PREP, M4_PACKED = "mistral_large4.prepare_cp_inputs", "mistral_large4.prepare_packed_cp_inputs"
GATHER_TOK, LOSS = "mistral_large4.gather_tokens", "mistral_large4.shifted_cp_loss"

# The catalogue is data: one entry a line, read as a table (the formatter would give each field a line of its own)
# fmt: off
CATALOGUE: tuple[Malformed, ...] = (
    # ---- inkling2.unpack_row_layout: THD metadata ------------------------------------------------
    Malformed(name="unpack/negative_real_length", function=UNPACK, base="inkling2_thd",
        mutations=(_set(SL, [0, 1], -2),), fields=("seq_lens",), why="a negative real length"),
    Malformed(name="unpack/negative_padded_length", function=UNPACK, base="inkling2_thd",
        mutations=(_set(SLP, [0, 2], -1),), fields=("seq_lens_padded",), why="a negative padded length"),
    Malformed(name="unpack/negative_not_filler", function=UNPACK, base="inkling2_thd",
        mutations=(_set(SL, [1, 1], -999), _set(SLP, [1, 1], -999)), fields=("seq_lens",),
        why="a negative length that is not the -1000 filler"),
    Malformed(name="unpack/length_after_filler", function=UNPACK, base="inkling2_thd",
        mutations=(_set(SL, [1, 2], 2), _set(SLP, [1, 2], 2)), fields=("seq_lens",),
        why="a real length after the -1000 filler"),
    Malformed(name="unpack/filler_in_one_only", function=UNPACK, base="inkling2_thd",
        mutations=(_set(SLP, [1, 1], 3),), fields=("seq_lens",),
        why="the filler in seq_lens but a length in seq_lens_padded"),
    Malformed(name="unpack/real_exceeds_padded", function=UNPACK, base="inkling2_thd",
        mutations=(_set(SL, [0, 0], 5),), fields=("seq_lens",), why="real length > padded length"),
    Malformed(name="unpack/padded_sum_exceeds_sequence", function=UNPACK, base="inkling2_thd",
        mutations=(_set(SLP, [0, 2], 7),), fields=("seq_lens_padded",),
        why="padded lengths summing past the sequence"),
    Malformed(name="unpack/padded_sum_overflows_int64", function=UNPACK, base="inkling2_thd",
        mutations=(_set(SLP, [0, 0], 2**62), _set(SLP, [0, 1], 2**62)), fields=("seq_lens_padded",),
        why="padded lengths whose int64 sum wraps around to a negative number"),
    Malformed(name="unpack/documents_disagree", function=UNPACK, base="inkling2_thd",
        mutations=(_op("narrow", SL, dim=1, drop=1),), fields=("seq_lens",),
        why="seq_lens and seq_lens_padded with different numbers of documents"),
    Malformed(name="unpack/lengths_wrong_batch", function=UNPACK, base="inkling2_thd",
        mutations=(_op("narrow", SL, dim=0, drop=1), _op("narrow", SLP, dim=0, drop=1)), fields=("seq_lens",),
        why="one row of lengths for a batch of two rows"),
    Malformed(name="unpack/lengths_one_dimensional", function=UNPACK, base="inkling2_thd",
        mutations=(_op("reshape", SL, shape=[-1]), _op("reshape", SLP, shape=[-1])), fields=("seq_lens",),
        why="1-D lengths instead of [batch, documents]"),
    Malformed(name="unpack/lengths_float", function=UNPACK, base="inkling2_thd",
        mutations=(_op("dtype", SL, dtype="float32"), _op("dtype", SLP, dtype="float32")), fields=("seq_lens",),
        why="floating-point lengths", errors=BOTH),
    Malformed(name="unpack/lengths_not_tensor", function=UNPACK, base="inkling2_thd",
        mutations=(_assign(SL, "3,2,1"),), fields=("seq_lens",), why="a string where the lengths tensor belongs",
        errors=BOTH),
    Malformed(name="unpack/missing_seq_lens_padded", function=UNPACK, base="inkling2_thd",
        mutations=(_op("delete", SLP),), fields=("seq_lens_padded",), why="seq_lens without seq_lens_padded"),
    Malformed(name="unpack/position_ids_disagree", function=UNPACK, base="inkling2_thd",
        mutations=(_op("tensor", "batch.position_ids", shape=[2, 12], arange=True),), fields=("position_ids",),
        why="given position_ids that run on across documents (disagree with the pack on real tokens)"),
    Malformed(name="unpack/position_ids_float", function=UNPACK, base="inkling2_thd",
        mutations=(_op("tensor", "batch.position_ids", shape=[2, 12], arange=True, dtype="float32"),),
        fields=("position_ids",), why="floating-point position_ids", errors=BOTH),
    Malformed(name="unpack/position_ids_wrong_shape", function=UNPACK, base="inkling2_thd",
        mutations=(_op("tensor", "batch.position_ids", shape=[2, 11], arange=True),), fields=("position_ids",),
        why="position_ids shorter than the sequence"),
    Malformed(name="unpack/labels_wrong_shape", function=UNPACK, base="inkling2_thd",
        mutations=(_op("narrow", "batch.labels", dim=1, drop=2),), fields=("labels",),
        why="labels shorter than input_ids"),
    Malformed(name="unpack/input_ids_float", function=UNPACK, base="inkling2_thd",
        mutations=(_op("dtype", "batch.input_ids", dtype="float32"),), fields=("input_ids",),
        why="floating-point input_ids", errors=BOTH),
    Malformed(name="unpack/batch_not_a_dict", function=UNPACK, base="inkling2_thd",
        mutations=(_assign("batch", [1, 2, 3]),), fields=("batch",), why="a list where the batch dict belongs",
        errors=BOTH),
    # ---- inkling2.validate_document_positions --------------------------------------------------------
    Malformed(name="positions/gap_resumes_document", function=VALIDATE, base="positions",
        mutations=(_set("positions", [0, 4], 4), _set("positions", [0, 5], 5)), fields=("positions",),
        why="after a gap of padding the count resumes the previous document instead of restarting at 0"),
    Malformed(name="positions/negative", function=VALIDATE, base="positions",
        mutations=(_set("positions", [1, 0], -1),), fields=("positions",), why="a negative position on a kept token"),
    Malformed(name="positions/jump_inside_document", function=VALIDATE, base="positions",
        mutations=(_set("positions", [1, 2], 5),), fields=("positions",),
        why="a position that is neither prev + 1 nor 0"),
    Malformed(name="positions/keep_not_bool", function=VALIDATE, base="positions",
        mutations=(_op("dtype", "keep", dtype="int64"),), fields=("keep",), why="an integer keep mask", errors=BOTH),
    Malformed(name="positions/positions_float", function=VALIDATE, base="positions",
        mutations=(_op("dtype", "positions", dtype="float32"),), fields=("positions",),
        why="floating-point positions", errors=BOTH),
    Malformed(name="positions/shapes_differ", function=VALIDATE, base="positions",
        mutations=(_op("narrow", "positions", dim=1, drop=1),), fields=("keep", "positions"),
        why="keep and positions of different shapes"),
    Malformed(name="positions/one_dimensional", function=VALIDATE, base="positions",
        mutations=(_op("reshape", "keep", shape=[-1]), _op("reshape", "positions", shape=[-1])),
        fields=("keep", "positions"), why="1-D keep and positions instead of [batch, sequence]"),
    # ---- inkling2.prepare_cp_inputs -------------------------------------------------------------------
    Malformed(name="inkling2_prepare/num_chunks_not_divisor", function=INK_PREP, base="inkling2_bshd",
        mutations=(_assign("num_chunks", 2),), fields=("num_chunks",),
        why="batch size 3 not divisible by num_chunks=2"),
    Malformed(name="inkling2_prepare/num_chunks_zero", function=INK_PREP, base="inkling2_bshd",
        mutations=(_assign("num_chunks", 0),), fields=("num_chunks",), why="num_chunks=0"),
    Malformed(name="inkling2_prepare/num_chunks_float", function=INK_PREP, base="inkling2_bshd",
        mutations=(_assign("num_chunks", 1.5),), fields=("num_chunks",), why="num_chunks=1.5", errors=BOTH),
    Malformed(name="inkling2_prepare/attention_mask_value", function=INK_PREP, base="inkling2_bshd",
        mutations=(_set("batch.attention_mask", [0, 3], 2),), fields=("attention_mask",),
        why="an attention_mask entry of 2"),
    Malformed(name="inkling2_prepare/attention_mask_float", function=INK_PREP, base="inkling2_bshd",
        mutations=(_op("dtype", "batch.attention_mask", dtype="float32"),), fields=("attention_mask",),
        why="a floating-point attention_mask", errors=BOTH),
    Malformed(name="inkling2_prepare/attention_mask_hole", function=INK_PREP, base="inkling2_bshd",
        mutations=(_set("batch.attention_mask", [1, 4], 0),), fields=("attention_mask",),
        why="padding between real tokens of an unpacked row (the real tokens resume after a gap)"),
    Malformed(name="inkling2_prepare/attention_mask_wrong_shape", function=INK_PREP, base="inkling2_bshd",
        mutations=(_op("narrow", "batch.attention_mask", dim=1, drop=1),), fields=("attention_mask",),
        why="an attention_mask shorter than the sequence"),
    Malformed(name="inkling2_prepare/image_mask_not_bool", function=INK_PREP, base="inkling2_bshd",
        mutations=(_op("dtype", "batch.image_mask", dtype="int64"),), fields=("image_mask",),
        why="an integer image_mask", errors=BOTH),
    Malformed(name="inkling2_prepare/image_mask_wrong_shape", function=INK_PREP, base="inkling2_bshd",
        mutations=(_op("narrow", "batch.image_mask", dim=0, drop=1),), fields=("image_mask",),
        why="an image_mask with too few rows"),
    Malformed(name="inkling2_prepare/pixel_values_two_dimensional", function=INK_PREP, base="inkling2_bshd",
        mutations=(_op("tensor", "batch.pixel_values", shape=[3, 8], fill=0.5, dtype="float64"),),
        fields=("pixel_values",), why="pixel_values that are neither a list of [C, H, W] nor [images, C, H, W]",
        errors=BOTH),
    Malformed(name="inkling2_prepare/position_ids_negative", function=INK_PREP, base="inkling2_bshd",
        mutations=(_op("tensor", "batch.position_ids", shape=[3, 9], arange=True, offset=-3),),
        fields=("position_ids",), why="position_ids negative at a real token"),
    Malformed(name="inkling2_prepare/position_ids_jump", function=INK_PREP, base="inkling2_bshd",
        mutations=(_op("tensor", "batch.position_ids", shape=[3, 9], arange=True), _set("batch.position_ids", [1, 5], 9)),
        fields=("position_ids",), why="position_ids that jump inside a document"),
    Malformed(name="inkling2_prepare/no_input_ids", function=INK_PREP, base="inkling2_bshd",
        mutations=(_op("delete", "batch.input_ids"),), fields=("input_ids",), why="a batch without input_ids"),
    Malformed(name="inkling2_prepare/labels_float", function=INK_PREP, base="inkling2_bshd",
        mutations=(_op("dtype", "batch.labels", dtype="float32"),), fields=("labels",), why="floating-point labels",
        errors=BOTH),
    Malformed(name="inkling2_prepare/packed_negative_length", function=INK_PREP, base="inkling2_thd",
        mutations=(_set(SL, [1, 0], -5),), fields=("seq_lens",),
        why="a negative length in a packed batch (prepare goes through unpack_row_layout)"),
    Malformed(name="inkling2_prepare/packed_num_chunks_not_divisor", function=INK_PREP, base="inkling2_thd",
        mutations=(_assign("num_chunks", 3),), fields=("num_chunks",),
        why="batch size 2 not divisible by num_chunks=3"),
    # ---- mistral_large4.prepare_cp_inputs / prepare_packed_cp_inputs --------------------------------------
    Malformed(name="mistral_prepare/num_chunks_not_divisor", function=M4_PREP, base="mistral_bshd",
        mutations=(_assign("num_chunks", 2),), fields=("num_chunks",),
        why="batch size 3 not divisible by num_chunks=2"),
    Malformed(name="mistral_prepare/num_chunks_negative", function=M4_PREP, base="mistral_bshd",
        mutations=(_assign("num_chunks", -1),), fields=("num_chunks",), why="num_chunks=-1"),
    Malformed(name="mistral_prepare/shard_primary_not_bool", function=M4_PREP, base="mistral_bshd",
        mutations=(_assign("shard_primary", "no"),), fields=("shard_primary",),
        why="shard_primary='no' (a truthy string)", errors=BOTH),
    Malformed(name="mistral_prepare/pixel_values_batched", function=M4_PREP, base="mistral_bshd",
        mutations=(_op("reshape", "batch.pixel_values", shape=[1, 3, 2, 4]),), fields=("pixel_values",),
        why="a batch of images where one complete [C, H, W] image belongs", errors=BOTH),
    Malformed(name="mistral_prepare/ids_and_embeddings", function=M4_PREP, base="mistral_bshd",
        mutations=(_op("tensor", "batch.inputs_embeds", shape=[3, 9, 4], fill=0.25, dtype="float32"),),
        fields=("input_ids", "inputs_embeds"), why="both input_ids and inputs_embeds (which one is the input?)"),
    Malformed(name="mistral_prepare/embeddings_two_dimensional", function=M4_PREP, base="mistral_bshd",
        mutations=(_op("delete", "batch.input_ids"), _op("tensor", "batch.inputs_embeds", shape=[3, 9], fill=0.25, dtype="float32")),
        fields=("inputs_embeds",), why="inputs_embeds without a hidden dimension", errors=BOTH),
    Malformed(name="mistral_prepare/attention_mask_negative", function=M4_PREP, base="mistral_bshd",
        mutations=(_set("batch.attention_mask", [2, 5], -1),), fields=("attention_mask",),
        why="an attention_mask entry of -1"),
    Malformed(name="mistral_prepare/packed_negative_length", function=M4_PREP, base="mistral_thd",
        mutations=(_set(SL, [0, 0], -1),), fields=("seq_lens",),
        why="a negative length in a packed batch (dispatched to prepare_packed_cp_inputs)"),
    Malformed(name="mistral_packed/batch_size_not_num_chunks", function=M4_PACKED, base="mistral_thd",
        mutations=(_assign("num_chunks", 1),), fields=("num_chunks",),
        why="two packed rows for num_chunks=1 (one packed row per micro-batch)"),
    Malformed(name="mistral_packed/real_exceeds_padded", function=M4_PACKED, base="mistral_thd",
        mutations=(_set(SL, [1, 0], 9),), fields=("seq_lens",), why="real length > padded length"),
    Malformed(name="mistral_packed/padded_sum_exceeds_sequence", function=M4_PACKED, base="mistral_thd",
        mutations=(_set(SLP, [0, 1], 7),), fields=("seq_lens_padded",),
        why="padded lengths summing past the sequence"),
    Malformed(name="mistral_packed/no_lengths", function=M4_PACKED, base="mistral_thd",
        mutations=(_op("delete", SL), _op("delete", SLP)), fields=("seq_lens",),
        why="a packed call without seq_lens/seq_lens_padded"),
    # ---- inkling2.gather_sequence ------------------------------------------------------------------------
    Malformed(name="gather_sequence/local_length_differs", function=GATHER_SEQ, base="sequence_shard",
        mutations=(_op("narrow", "value", dim=1, drop=1, ranks=[1]),), fields=("value",),
        why="local shards of different lengths on different ranks", min_world_size=2),
    Malformed(name="gather_sequence/dtype_differs", function=GATHER_SEQ, base="sequence_shard",
        mutations=(_op("dtype", "value", dtype="float32", ranks=[0]),), fields=("value",),
        why="float32 on rank 0, float64 elsewhere", min_world_size=2),
    Malformed(name="gather_sequence/one_dimensional", function=GATHER_SEQ, base="sequence_shard",
        mutations=(_op("reshape", "value", shape=[-1]),), fields=("value",),
        why="a 1-D value without a sequence dimension"),
    Malformed(name="gather_sequence/differentiable_not_bool", function=GATHER_SEQ, base="sequence_shard",
        mutations=(_assign("differentiable", "yes"),), fields=("differentiable",), why="differentiable='yes'",
        errors=BOTH),
    Malformed(name="gather_sequence/differentiable_differs", function=GATHER_SEQ, base="sequence_shard",
        mutations=(_assign("differentiable", False, ranks=[-1]),), fields=("differentiable",),
        why="differentiable=False on the last rank only (its backward would never join the others')",
        min_world_size=2),
    Malformed(name="gather_sequence/mesh_two_dimensional", function=GATHER_SEQ, base="sequence_shard",
        mutations=(_op("mesh", kind="2d"),), fields=("mesh",),
        why="a (dp=1, cp=N) 2-D mesh instead of its 1-D cp sub-mesh", errors=BOTH),
    Malformed(name="gather_sequence/mesh_not_a_mesh", function=GATHER_SEQ, base="sequence_shard",
        mutations=(_op("mesh", kind="string"),), fields=("mesh",), why="the string 'cp' as mesh", errors=BOTH),
    Malformed(name="gather_sequence/value_not_tensor", function=GATHER_SEQ, base="sequence_shard",
        mutations=(_op("tolist", "value"),), fields=("value",), why="a nested list instead of a tensor", errors=BOTH),
    # ---- mistral_large4.gather_tokens -----------------------------------------------------------------------
    Malformed(name="gather_tokens/token_count_differs", function=GATHER_TOK, base="token_shard",
        mutations=(_op("narrow", "value", dim=0, drop=1, ranks=[0]),), fields=("value",),
        why="different local token counts on different ranks", min_world_size=2),
    Malformed(name="gather_tokens/features_differ", function=GATHER_TOK, base="token_shard",
        mutations=(_op("narrow", "value", dim=1, drop=1, ranks=[-1]),), fields=("value",),
        why="different trailing shapes on different ranks", min_world_size=2),
    Malformed(name="gather_tokens/zero_dimensional", function=GATHER_TOK, base="token_shard",
        mutations=(_op("tensor", "value", shape=[], fill=1.0, dtype="float64"),), fields=("value",),
        why="a 0-D value"),
    Malformed(name="gather_tokens/mesh_two_dimensional", function=GATHER_TOK, base="token_shard",
        mutations=(_op("mesh", kind="2d"),), fields=("mesh",), why="a (dp=1, cp=N) 2-D mesh", errors=BOTH),
    # ---- inkling2.convolution_history -------------------------------------------------------------------------
    Malformed(name="convolution_history/width_zero", function=HISTORY, base="history_shard",
        mutations=(_assign("width", 0),), fields=("width",), why="width=0"),
    Malformed(name="convolution_history/width_negative", function=HISTORY, base="history_shard",
        mutations=(_assign("width", -2),), fields=("width",), why="width=-2"),
    Malformed(name="convolution_history/width_float", function=HISTORY, base="history_shard",
        mutations=(_assign("width", 2.0),), fields=("width",), why="width=2.0", errors=BOTH),
    Malformed(name="convolution_history/width_differs", function=HISTORY, base="history_shard",
        mutations=(_assign("width", 4, ranks=[1]),), fields=("width",), why="width 4 on rank 1, 3 elsewhere",
        min_world_size=2),
    Malformed(name="convolution_history/local_length_differs", function=HISTORY, base="history_shard",
        mutations=(_op("narrow", "masked", dim=1, drop=1, ranks=[0]),), fields=("masked",),
        why="local shards of different lengths on different ranks", min_world_size=2),
    Malformed(name="convolution_history/channels_differ", function=HISTORY, base="history_shard",
        mutations=(_op("narrow", "masked", dim=2, drop=1, ranks=[-1]),), fields=("masked",),
        why="different channel counts on different ranks", min_world_size=2),
    Malformed(name="convolution_history/two_dimensional", function=HISTORY, base="history_shard",
        mutations=(_op("reshape", "masked", shape=[2, 12]),), fields=("masked",), why="a 2-D shard without channels"),
    Malformed(name="convolution_history/mesh_two_dimensional", function=HISTORY, base="history_shard",
        mutations=(_op("mesh", kind="2d"),), fields=("mesh",), why="a (dp=1, cp=N) 2-D mesh", errors=BOTH),
    # ---- mistral_large4.shifted_cp_loss -------------------------------------------------------------------------
    Malformed(name="shifted_cp_loss/labels_wrong_shape", function=LOSS, base="loss_shard",
        mutations=(_op("narrow", "labels", dim=1, drop=1),), fields=("labels",),
        why="labels shorter than the logits"),
    Malformed(name="shifted_cp_loss/labels_float", function=LOSS, base="loss_shard",
        mutations=(_op("dtype", "labels", dtype="float32"),), fields=("labels",), why="floating-point labels",
        errors=BOTH),
    Malformed(name="shifted_cp_loss/valid_not_bool", function=LOSS, base="loss_shard",
        mutations=(_op("dtype", "valid", dtype="int64"),), fields=("valid",), why="an integer valid mask",
        errors=BOTH),
    Malformed(name="shifted_cp_loss/valid_wrong_length", function=LOSS, base="loss_shard",
        mutations=(_op("narrow", "valid", dim=0, drop=1),), fields=("valid",),
        why="valid shorter than batch * local_sequence"),
    Malformed(name="shifted_cp_loss/label_out_of_range_one_rank", function=LOSS, base="loss_shard",
        mutations=(_set("labels", [0, 1], 99, ranks=[1]),), fields=("labels",),
        why="a label outside [0, vocab) at a valid position, on rank 1 only", min_world_size=2),
    Malformed(name="shifted_cp_loss/logits_integer", function=LOSS, base="loss_shard",
        mutations=(_op("dtype", "logits", dtype="int64"),), fields=("logits",), why="integer logits", errors=BOTH),
    Malformed(name="shifted_cp_loss/local_length_differs", function=LOSS, base="loss_shard",
        mutations=(_op("narrow", "logits", dim=1, drop=1, ranks=[0]), _op("narrow", "labels", dim=1, drop=1, ranks=[0]), _op("narrow", "valid", dim=0, drop=2, ranks=[0])),
        fields=("logits", "labels", "valid"),
        why="shards of different lengths (each consistent in itself) on different ranks", min_world_size=2),
    Malformed(name="shifted_cp_loss/vocab_differs", function=LOSS, base="loss_shard",
        mutations=(_op("narrow", "logits", dim=2, drop=1, ranks=[-1]),), fields=("logits",),
        why="a different vocabulary on the last rank", min_world_size=2),
    Malformed(name="shifted_cp_loss/mesh_two_dimensional", function=LOSS, base="loss_shard",
        mutations=(_op("mesh", kind="2d"),), fields=("mesh",), why="a (dp=1, cp=N) 2-D mesh", errors=BOTH),
    # ---- the sharder -------------------------------------------------------------------------------------------
    Malformed(name="sharder/shard_batch_two_dimensional_mesh", function="sharder.shard_batch",
        base="inkling2_bshd_mesh", mutations=(_op("mesh", kind="2d"),), fields=("mesh",),
        why="shard_batch given a (dp=1, cp=N) 2-D mesh as its CP mesh", errors=BOTH),
)
# fmt: on

BY_NAME: dict[str, Malformed] = {m.name: m for m in CATALOGUE}
if len(BY_NAME) != len(CATALOGUE):  # pragma: no cover - a catalogue edit error
    raise RuntimeError("cp_harness.cases.malformed_catalogue: duplicate entry names")


def world_size_for(entry: Malformed, index: int, available: tuple[int, ...], preferred=(2, 3, 4)) -> int | None:
    """The CP size an entry runs at: its fixed size, else ``preferred`` in turn, within ``available``.

    ``None`` when no available size is large enough.
    """
    usable = sorted(s for s in available if s >= max(entry.min_world_size, 2)) or sorted(
        s for s in available if s >= entry.min_world_size
    )
    if entry.world_size is not None:
        return entry.world_size if entry.world_size <= max(available) else None
    if not usable:
        return None
    want = preferred[index % len(preferred)]
    fits = [s for s in usable if s >= want]
    return fits[0] if fits else usable[-1]
