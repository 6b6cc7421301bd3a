"""The failing cases the standalone-repro tests export: one per broken fixture of ``tests/fixtures`` (each fails
there and passes on ``cp_impl``), and the model specs of ``tests/checks/test_real_model.py`` (slow: nightly).
The documented framework defects come from ``examples/automodel/known_defects.json``."""

_INKLING2_THD = {"check": "inkling2_layout", "world_size": 2, "seed": 1, "model": "inkling2", "num_chunks": 1,
                 "batch": {"format": "thd", "seq_len": 9, "docs": [[[3, 4], [4, 4]], [[2, 2], [5, 6]]],
                           "eos_is_pad": True}}
_LOSS_MASK = {"check": "loss_mask_layout", "world_size": 3, "seed": 4, "model": "inkling2", "num_chunks": 1,
              "loss_mask": "bool", "batch": {"format": "thd", "seq_len": 7, "docs": [[[3, 3], [4, 4]]]}}
_LOSS = {"check": "shifted_cp_loss", "world_size": 2, "seed": 6, "model": "mistral_large4", "dtype": "float64",
         "vocab": 5, "batch": {"format": "thd", "seq_len": 8, "docs": [[[3, 4], [4, 4]]]}}
_LOSS_ON_GROUP_1 = {"check": "shifted_cp_loss", "world_size": 2, "seed": 204, "model": "mistral_large4",
                    "dtype": "float64", "vocab": 7, "batch": {"format": "thd", "seq_len": 10, "docs": [[[4, 5], [5, 5]]]},
                    "mesh_layout": {"dims": ["dp", "cp"], "shape": [2, 2], "run": [1]}}

# fixture -> (a case it fails, what its script must print while the defect is there)
# The fixtures whose broken script ends only when its ``--timeout`` fires (a message sent to the wrong rank is never
# received, and the rank waiting for it raises): their documented failure is that raise, so a short timeout there
# decides nothing a long one would, while their passing runs keep the long one.
WAITS_FOR_A_MESSAGE = frozenset({"broken_mesh_loss_peer_cp_rank"})
FIXTURES = {
    "broken_gate_docs_full_length": ({
        "check": "mistral_large4_layout", "world_size": 3, "seed": 2, "model": "mistral_large4", "num_chunks": 1,
        "shard_primary": True, "direct_packed": True,
        "batch": {"format": "thd", "seq_len": 8, "docs": [[[3, 3], [4, 5]]], "eos_is_pad": True}},
        "document_ids is not sharded like the tokens"),
    "broken_gate_halo": ({"check": "convolution_history", "world_size": 2, "seed": 3, "dtype": "float64",
                          "shape": [1, 2, 2], "width": 3}, "rank 1: output: 2 of 8 elements differ"),
    "broken_gate_index_map": (_INKLING2_THD, "its local labels are those of positions"),
    "broken_gate_labels_pad_zero": (_INKLING2_THD, "divisibility padding): got 0, expected -100"),
    "broken_gate_loss_local_count": (_LOSS, "more than 16 ULP"),
    "broken_gate_loss_mask_dropped": (_LOSS_MASK, "the local batch holds no 'loss_mask'"),
    "broken_gate_loss_mask_padding": (_LOSS_MASK, "divisibility padding): got True, expected False"),
    "broken_gate_unpack_eos": (_INKLING2_THD, "unpack_row_layout padding_mask"),
    "broken_gate_verbs_fill": ({
        "check": "sharder_verbs", "world_size": 2, "seed": 12, "model": "inkling2", "layout": "strategy", "rows": 2,
        "seq_len": 5, "dtype": "bfloat16",
        "forms": [{"lead": [], "trail": [4], "coords": "caller", "fill": 0.5, "trim": True},
                  {"lead": [], "trail": [3], "coords": "padded", "fill": 0, "trim": False}]},
        "but shard_token_tensor(arange(S)) cuts"),
    "broken_gate_verbs_seq_dim": ({
        "check": "sharder_verbs", "world_size": 3, "seed": 11, "model": "mistral_large4", "layout": "strategy",
        "rows": 2, "seq_len": 5, "dtype": "float64", "value_dtype": "int64",
        "forms": [{"lead": [3], "trail": [], "coords": "caller", "fill": -1, "trim": True},
                  {"lead": [], "trail": [], "coords": "nofill", "fill": 0, "trim": True}]}, "raised"),
    "broken_prec_grad_bf16_sum": ({"check": "gather_sequence", "world_size": 3, "seed": 7, "dtype": "bfloat16",
                                   "shape": [2, 3, 4], "differentiable": True}, "grad value"),
    "broken_prec_kv_bf16": ({"check": "model", "world_size": 2, "seed": 12, "model": "mistral_large4",
                             "dtype": "float32", "num_chunks": 1, "shard_primary": False,
                             "batch": {"format": "bshd", "seq_len": 9, "rows": [[4, 5], [0, 9]]}}, "output"),
    "broken_prec_loss_low_sum": ({"check": "shifted_cp_loss", "world_size": 3, "seed": 7, "model": "mistral_large4",
                                  "dtype": "bfloat16", "vocab": 11,
                                  "batch": {"format": "bshd", "seq_len": 20, "rows": [[0, 20], [3, 17]]}},
                                 "output: 1 of 1 elements differ (more than 256 ULP)"),
    "broken_rel_loss_scale": (_LOSS, "more than 16 ULP"),
    "broken_rr_drops_loss_mask": (_LOSS_MASK, "the local batch holds no 'loss_mask'"),  # needs the framework
    # On world meshes (tests/verify/test_gate_meshes.py): the script builds the mesh and runs on mesh["cp"].
    "broken_mesh_halo_cp_rank": ({"check": "convolution_history", "world_size": 2, "seed": 202, "dtype": "float64",
                                  "shape": [2, 3, 2], "width": 3, "mesh_layout": {"dims": ["cp", "dp"], "shape": [2, 2]}},
                                 "is not part of group"),
    "broken_mesh_loss_peer_cp_rank": (_LOSS_ON_GROUP_1, "raised"),  # the label goes to rank 0: its peer waits
    # (in WAITS_FOR_A_MESSAGE)
    "broken_mesh_rank_from_world": (_LOSS_ON_GROUP_1, "is not part of group"),
    "broken_mesh_gather_world": ({"check": "gather_tokens", "world_size": 3, "seed": 203, "dtype": "bfloat16",
                                  "shape": [2, 3], "differentiable": True,
                                  "mesh_layout": {"dims": ["dp_shard", "cp", "tp"], "shape": [1, 3, 1], "ranks": [1, 2, 3]}},
                                 "allgather: invalid tensor size"),
}
NEEDS_FRAMEWORK = {"broken_rr_drops_loss_mask"}

# spec fixture -> (a case it fails, what its script prints)
SPECS = {
    "real_model_spec_local_count": ({
        "check": "real_model", "spec": "real_model_spec_local_count", "dtype": "float32", "seed": 0, "world_size": 2,
        "batch": {"kind": "packed", "seq_len": 19, "documents": [[7, 5, 6]], "seed": 1}}, "grad lm_head.weight: CP error"),
    "real_model_spec_gather_drops": ({
        "check": "real_model", "spec": "real_model_spec_gather_drops", "dtype": "bfloat16", "seed": 0, "world_size": 2,
        "batch": {"kind": "plain", "seq_len": 16, "seed": 2}}, "logits: CP error"),
    "real_model_spec_raises_rank1": ({
        "check": "real_model", "spec": "real_model_spec_raises_rank1", "dtype": "float32", "seed": 0, "world_size": 2,
        "batch": {"kind": "plain", "seq_len": 8, "seed": 0}}, "injected on rank 1"),
}
