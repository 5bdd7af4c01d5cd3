"""Offline export of a checkpoint whose experts were spread over ranks: every expert, renumbered or stacked."""

from __future__ import annotations

import torch

from angelptm.checkpoints import files as checkpoint
from angelptm.checkpoints.export import _gather_experts


def test_expert_lists_are_renumbered_and_stacked_experts_concatenated(tmp_path):
    dense, stacked = torch.randn(3), [torch.randn(2, 4), torch.randn(2, 4)]
    listed = [[torch.randn(5), torch.randn(5)], [torch.randn(5), torch.randn(5)]]  # [rank][local expert]

    def slice_of(rank: int) -> dict[str, torch.Tensor]:
        return {"moe.experts.w": stacked[rank], "moe.experts.experts.0.weight": listed[rank][0],
                "moe.experts.experts.1.weight": listed[rank][1]}

    expert_keys = sorted(slice_of(0))
    model_states = {"ep_size": 2, "expert_state_keys": expert_keys, "module": {"dense": dense, **slice_of(0)}}
    masters = {"dense": dense * 2, **{k: v * 2 for k, v in slice_of(0).items()}}
    checkpoint.write_file_durably({"experts": {"module": slice_of(1), "optimizer": {
        "masters": {"dense": dense * 2, **{k: v * 2 for k, v in slice_of(1).items()}}}}},
        tmp_path / checkpoint.rank_file(1))
    module, merged = _gather_experts(tmp_path, model_states, masters)
    expected = {"dense": dense, "moe.experts.w": torch.cat(stacked),
                **{f"moe.experts.experts.{2 * rank + i}.weight": listed[rank][i] for rank in (0, 1) for i in (0, 1)}}
    assert module.keys() == expected.keys() == merged.keys()
    for key, value in expected.items():
        assert torch.equal(module[key], value) and torch.equal(merged[key], value * 2), key
