"""The worker inside a training framework: ``lightning`` (the ``DiLoCo`` callback), ``accelerate``
(``DiLoCo`` for an Accelerate loop), and what both share (``shared``)."""
