"""Train a Llama with asynchronous DiLoCo (the same command as ``diloco-train`` of an installed wheel).

    python train.py recipe=tiny                       # master + 2 workers on this machine
    python train.py -m recipe=llama25m_tau8 outer=nesterov,cgad,adam_decay seed=0,1,2
    python train.py recipe=llama1b_tau8 role=worker node_index=3 run_id=exp1 hub=hf hub.url=hf://org/exp1
    python train.py recipe=llama1b_tau8 role=master run_id=exp1 hub=hf hub.url=hf://org/exp1 hub.create=true
    python train.py --help                            # every group and key, with its current value

All logic lives in ``diloco_lightning.app.run`` (what runs) and ``diloco_lightning.app.cli`` (errors,
signals, --help); configs in ``configs/``, recipes in ``recipes/``.
"""

from diloco_lightning.app.cli import train_main

if __name__ == "__main__":
    train_main()
