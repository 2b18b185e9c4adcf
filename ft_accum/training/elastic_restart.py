"""A torchrun restart (`--max_restarts`) whose workers can find each other again.

torchrun's agent hosts the rendezvous store (TORCHELASTIC_USE_AGENT_STORE) and, with its static
rendezvous (one machine, or `--rdzv_backend static`), keeps that one TCPStore for every restart; its
workers' `env://` rendezvous adds no prefix per attempt, on the assumption that each retry has a new
store (torch.distributed.rendezvous._create_c10d_store, torch 2.13). A restarted attempt's gloo
workers then read the addresses their killed predecessors published under the same keys, and fail
with "Connection refused" (measured: 2 CPU processes under `ft-accum launch --max_restarts 1`, one
killed). Here a restarted attempt rendezvouses through `env://` with its store scoped by the attempt
(`ft-accum-env://`, registered with torch's public `register_rendezvous_handler`): each attempt's
keys are its own. The first attempt, and launches without the agent's store, use `env://` unchanged.
"""

from __future__ import annotations

import os

SCHEME = "ft-accum-env"


def restart_attempt() -> int:
    """torchrun's restart count of this worker (0: the first attempt, or not under torchrun)."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))


def init_method() -> str | None:
    """The process group's `init_method` for Accelerate: attempt-scoped after a restart under the agent's
    store, else None (Accelerate's default, `env://`)."""
    if restart_attempt() == 0 or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    from torch.distributed.rendezvous import register_rendezvous_handler

    try:
        register_rendezvous_handler(SCHEME, attempt_scoped_env_rendezvous)
    except RuntimeError:  # registered by an earlier run in this process
        pass
    return f"{SCHEME}://"


def attempt_scoped_env_rendezvous(url: str, **kwargs):
    """torch's `env://` rendezvous, its store seen through a prefix naming this restart attempt."""
    from urllib.parse import urlparse

    from torch.distributed import PrefixStore
    from torch.distributed.rendezvous import rendezvous

    env_url = urlparse(url)._replace(scheme="env").geturl()  # the same query (rank, world_size)
    store, rank, world_size = next(rendezvous(env_url, **kwargs))
    yield PrefixStore(f"/ft_accum/attempt_{restart_attempt()}", store), rank, world_size
