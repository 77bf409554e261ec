"""Run by test_distributed.py under `torchrun --nproc-per-node 2`: trains each config of a JSON list in turn, in one
process group, and has rank 0 save each run's whole trained parameters (gathered from the shards).

    torchrun --standalone --nproc-per-node 2 tests/distributed_driver.py CONFIGS.json [--die-after-save STEP]

--die-after-save: every rank exits (status 17, no clean-up) right after the checkpoint of STEP is written, as a run
killed there would.
"""

import argparse
import json
import os

import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from fastgrpo.train import TrainConfig, Trainer, distributed

DIED = 17


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("configs")
    parser.add_argument("--die-after-save", type=int)
    args = parser.parse_args()
    for values in json.loads(open(args.configs).read()):
        params_file = values.pop("params_file")
        trainer = Trainer(TrainConfig(**values))
        if args.die_after_save is not None:
            save = trainer.save

            def save_then_die(trainer=trainer, save=save):
                path = save()
                if trainer.step == args.die_after_save:
                    os._exit(DIED)
                return path

            trainer.save = save_then_die
        trainer.train()
        whole = get_model_state_dict(trainer.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if trainer.world.is_main:
            torch.save({name: value.clone() for name, value in whole.items()}, params_file)
    del trainer, whole
    distributed.leave(finished=True)  # as `fastgrpo train` ends: wrappers, barrier, then the group


if __name__ == "__main__":
    main()
