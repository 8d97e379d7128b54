"""Train a Llama with asynchronous DiLoCo.

    python train.py recipe=tiny                       # master + 2 workers on this machine
    python train.py -m recipe=llama25m_tau8 outer=nesterov,cgad,adam_decay seed=0,1,2
    python train.py recipe=llama1b_tau8 role=worker node_index=3 run_id=exp1 hub=hf hub.url=hf://org/exp1
    python train.py recipe=llama1b_tau8 role=master run_id=exp1 hub=hf hub.url=hf://org/exp1

All logic lives in ``diloco_lightning.launch``; configs in ``configs/``, recipes in ``recipes/``.
"""

import hydra

from diloco_lightning.config import register_configs

register_configs()


@hydra.main(version_base=None, config_path="configs", config_name="train")
def main(cfg) -> float | None:
    from diloco_lightning.launch import run

    results = run(cfg)
    # The return value is what Hydra sweepers optimise: the final eval loss.
    return None if results is None else results.get("eval_loss")


if __name__ == "__main__":
    main()
