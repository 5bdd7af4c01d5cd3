"""One pipelined training step for the AutoPipe multi-process tests; started by torchrun.

    torchrun --nproc-per-node W tests/helpers/autopipe_job.py --stages S --schedule 1f1b --microbatches M \
        --data-seed N --out PREFIX

Rank 0 profiles the model and broadcasts the profile, every rank searches the same split, builds its
stages, runs one pipeline flush per replica (replica d takes the d-th slice of the batch), sums tied
gradients, averages over replicas, and writes ``PREFIX.<rank>`` with its gradients (and the loss, on
the ranks that compute it).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from reference import end_job  # noqa: E402

from angelptm.pretraining.models import ModelConfig, build_model  # noqa: E402
from autopipe.cost import CostSettings  # noqa: E402
from autopipe.graph import trace  # noqa: E402
from autopipe.profile import Profile  # noqa: E402
from autopipe.profiler import profile_graph  # noqa: E402
from autopipe.runtime import PipelineLayout, PipelineRunner  # noqa: E402
from autopipe.search import search  # noqa: E402

MICRO_BATCH, SEQ, VOCAB = 2, 16, 64


def model_config() -> ModelConfig:
    """Tied embeddings on purpose: the first and last stage share the token table."""
    return ModelConfig(flavour="llama", vocab_size=VOCAB, max_seq_len=SEQ, num_layers=2, hidden_size=32,
                       num_heads=4, tie_embeddings=True)


def batch(seed: int, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids and next-token labels, identical in every process."""
    ids = torch.randint(0, VOCAB, (rows, SEQ + 1), generator=torch.Generator().manual_seed(seed))
    return ids[:, :-1].contiguous(), ids[:, 1:].contiguous()


def shared_profile(graph, inputs: dict[str, torch.Tensor]) -> Profile:
    """Rank 0's profile on every rank (timings differ between processes; the split must not)."""
    holder = [profile_graph(graph, inputs, warmup=0, repeats=1).to_json() if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(holder, src=0)
    return Profile.from_json(holder[0])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--stages", type=int, required=True)
    parser.add_argument("--chunks-per-rank", type=int, default=1)
    parser.add_argument("--schedule", required=True)
    parser.add_argument("--microbatches", type=int, required=True)
    parser.add_argument("--data-seed", type=int, required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = build_model(model_config())
    layout = PipelineLayout(world_size=world, num_stages=args.stages, virtual_stages_per_rank=args.chunks_per_rank)
    ids, labels = batch(args.data_seed, layout.num_replicas * args.microbatches * MICRO_BATCH)
    example = {"input_ids": ids[:MICRO_BATCH], "labels": labels[:MICRO_BATCH]}
    graph = trace(model, example, "labels")
    profile = shared_profile(graph, example)
    settings = CostSettings(num_stages=args.stages, num_microbatches=args.microbatches, schedule=args.schedule,
                            virtual_stages_per_rank=args.chunks_per_rank)
    units = profile.unit_op_starts(max_cut_tensors=2)
    plan = search(profile.to_chain(max_cut_tensors=2), settings)
    runner = PipelineRunner(graph, [units[u] for u in plan.stage_starts], layout, rank, torch.device("cpu"),
                            schedule=args.schedule, num_microbatches=args.microbatches,
                            loss_scale=1.0 / args.microbatches)
    rows = slice((rank // args.stages) * args.microbatches * MICRO_BATCH,
                 (rank // args.stages + 1) * args.microbatches * MICRO_BATCH)
    loss = runner.step({"input_ids": ids[rows]}, labels[rows])
    runner.sync_tied_gradients(lambda name, param: param.grad)
    for _, param in runner.named_parameters():  # data parallel: mean over replicas
        if layout.num_replicas > 1:
            dist.all_reduce(param.grad, group=runner.data_parallel_group)
            param.grad /= layout.num_replicas
    if loss is not None and layout.num_replicas > 1:
        dist.all_reduce(loss, group=runner.data_parallel_group)
        loss /= layout.num_replicas
    torch.save({"loss": loss, "grads": {name: p.grad for name, p in runner.named_parameters()},
                "chunks": runner.chunk_ids, "tied": runner.tied_parameter_names, "op_starts": plan.stage_starts},
               f"{args.out}.{rank}")
    end_job()  # destroys the process group and exits


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
