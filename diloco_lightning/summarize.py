"""``python -m diloco_lightning.summarize runs/multirun``: the sweep summary (see
:mod:`diloco_lightning.app.summarize`; this module only keeps the command's name)."""

from diloco_lightning.app.summarize import main

if __name__ == "__main__":
    main()
