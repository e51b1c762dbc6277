"""One rank of a 2-process torch.distributed (gloo, CPU) run that puts given per-rank gradients
through PyTorch DDP's own communication hooks, for tests/test_oracles.py:

    python tests/scripts/torch_hooks.py RANK WORLD_SIZE 127.0.0.1:PORT DIR

DIR/config.json names the experiments and DIR/inputs.npz holds their arrays (the test writes both):

* "bf16": `default_hooks.bf16_compress_hook` on a float32 bucket, step by step;
* each of "powersgd": `powerSGD_hook.powerSGD_hook` (error feedback, warm start) on a float64
  bucket, its warm-start memory filled beforehand with the test's initial Q, so that the hook starts
  from the same Q as jaxdp (its own first draw would come from the hook's private RNG).

DIR/out.RANK.npz gets, per step, the bucket the hook returned (the averaged gradients) and for
PowerSGD the rank's error feedback and the shared Q after the step. The last line printed is
`done=1`.

A DDP bucket (`dist.GradBucket`) has no Python constructor; `Bucket` has the four methods the hooks
call (buffer, index, is_last, gradients), gradients being views of the one buffer as in DDP.
"""

import json
import sys

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook


class Bucket:
    """Bucket 0, the only one (so the last of each iteration), over tensors of `shapes`."""

    def __init__(self, flat: torch.Tensor, shapes: list[list[int]]):
        self._buffer, self._shapes = flat, [torch.Size(s) for s in shapes]

    def buffer(self) -> torch.Tensor:
        return self._buffer

    def index(self) -> int:
        return 0

    def is_last(self) -> bool:
        return True

    def gradients(self) -> list[torch.Tensor]:
        views, at = [], 0
        for shape in self._shapes:
            views.append(self._buffer[at:at + shape.numel()].view(shape))
            at += shape.numel()
        return views


def main() -> None:
    rank, world, address, directory = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://{address}", rank=rank, world_size=world)
    config = json.load(open(f"{directory}/config.json"))
    inputs = np.load(f"{directory}/inputs.npz")
    out = {}

    grads = inputs["bf16_grads"][rank]  # (steps, bucket size), float32
    for step, flat in enumerate(grads):
        bucket = Bucket(torch.from_numpy(flat.copy()), config["bf16"]["shapes"])
        out[f"bf16.{step}"] = default_hooks.bf16_compress_hook(None, bucket).wait().numpy().copy()

    for run in config["powersgd"]:
        name = run["name"]
        state = powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=run["rank"],
                                            start_powerSGD_iter=run["start"], use_error_feedback=True,
                                            warm_start=True)
        # The warm-start memory, as the hook allocates it at its first compressed step: P's is
        # overwritten before it is read, Q's is the initial Q (each compressed tensor's (1, m, r), in order).
        state.p_memory_dict[0] = torch.empty(run["p_size"], dtype=torch.float64)
        state.q_memory_dict[0] = torch.from_numpy(inputs[f"{name}_q0"].copy())
        for step, flat in enumerate(inputs[f"{name}_grads"][rank]):
            bucket = Bucket(torch.from_numpy(flat.copy()), run["shapes"])
            out[f"{name}.mean.{step}"] = powerSGD_hook.powerSGD_hook(state, bucket).wait().numpy().copy()
            if 0 in state.error_dict:
                out[f"{name}.error.{step}"] = state.error_dict[0].numpy().copy()
                out[f"{name}.q.{step}"] = state.q_memory_dict[0].numpy().copy()

    np.savez(f"{directory}/out.{rank}.npz", **out)
    dist.destroy_process_group()
    print("done=1", flush=True)


if __name__ == "__main__":
    main()
