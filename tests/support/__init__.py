"""What several test files share: the environment of a subprocess running this checkout
(``env.py``), processes released at once to race (``racers.py``), two real workers on threads
against a real master (``workers.py``), the loopback servers
(``hf_server.py``: a fake Hugging Face Hub; ``s3_proxy.py``: a fault-injecting proxy in front of
moto's S3 server; ``slurm_cluster.py``: a one-node SLURM cluster), and the scripts the tests run
and kill (``master_crash_script.py``, ``worker_crash_script.py``, ``ddp_callback_script.py``,
``speedtronic_side.py``: the Speedtronic side of the compat tests).

``tests/`` is on ``sys.path`` under pytest (``tests/conftest.py`` is a rootdir conftest), so
test files import ``support.env`` and the like.
"""
