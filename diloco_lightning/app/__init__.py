"""The Hydra product: ``train.py`` / ``diloco-train`` and ``diloco-master``.

It depends on the library (hub, master, worker, integrations, models, data) and nothing in
the library imports it. See ``docs/design.md`` for the map.
"""
