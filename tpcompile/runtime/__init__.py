"""Running rank graphs: spawned processes, torchrun, the in-process simulator, parallelize()."""
from tpcompile.runtime.launch import free_port, launch
from tpcompile.runtime.torchrun import DEFAULT_TIMEOUT_S, collective_timeout, init_from_env, shutdown

__all__ = ["DEFAULT_TIMEOUT_S", "collective_timeout", "free_port", "init_from_env", "launch", "shutdown"]
