"""Service configuration: environment variables ``MEGAMOE_*`` and ``megamoe serve`` flags.

Every field is both an env var (``MEGAMOE_QUEUE_DELAY_MS``) and a flag
(``--queue-delay-ms``); a flag wins over the environment. A setting whose default is
"unset" takes the word ``unset`` (or an empty value) to mean that.
"""

from __future__ import annotations

from pathlib import Path

from pydantic import Field, SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict
from typing_extensions import TypeAliasType

#: datatypes the metadata may advertise for hidden_states and output (--hidden-datatype)
HIDDEN_DATATYPES = ("FP32", "BF16")


#: the token's type: a SecretStr (never printed, ``**********`` in reprs and errors), under an alias
#: whose name is what --help shows for it, a string like every other text flag (SecretStr's own
#: name read as a placeholder to fill in)
BearerToken = TypeAliasType("str", SecretStr)


class ServiceSettings(BaseSettings):
    model_config = SettingsConfigDict(
        env_prefix="MEGAMOE_",
        cli_prog_name="megamoe serve",
        cli_kebab_case=True,
        cli_implicit_flags=True,
        cli_hide_none_type=True,
        cli_parse_none_str="unset",
        cli_show_env_vars=True,
        hide_input_in_errors=True,  # a rejected token must not be printed
        extra="ignore",
    )

    checkpoint: str | None = Field(
        None, description="NVFP4 MoE checkpoint to serve (ModelOpt or compressed-tensors; a directory or one "
        ".safetensors file); unset: the synthetic preset. One that cannot be loaded stops the server with exit status 1"
    )
    layer: str | None = Field(
        None, description="with a checkpoint: the MoE layer to serve, the model's layer number (model.layers.N) or a "
        "tensor-name prefix; unset: the first MoE layer (`megamoe info --checkpoint DIR` lists them)"
    )
    preset: str = Field("small", description="synthetic preset served when no checkpoint is given (tiny, small, v4-flash, v3)")
    seed: int = Field(0, description="seed of the synthetic preset's weights")
    model_name: str | None = Field(
        None, description="model name in the URL (/v2/models/<name>); unset: the preset name, the checkpoint "
        "folder's name, or the checkpoint file's name without .safetensors"
    )
    backend: str = Field(
        "auto",
        description="kernel backend: auto, torch, cuda-sm90, cuda-sm100, or 'package.module:attr' (a Backend subclass or factory)",
    )
    device: str | None = Field(None, description="torch device for the weights; unset: the backend's")
    batch_invariant: bool = Field(
        True, description="a request's answer does not depend on the rest of its batch: the router's and the shared "
        "expert's float32 GEMMs run in fixed 64-row blocks and cuda-sm90 runs one kernel family at every batch size "
        "(docs/SPEC.md §3.5). Off: one GEMM each and the streaming decode for few tokens per expert, faster on a GPU "
        "for large batches and for one token (docs/PERFORMANCE.md), and a row's bits may then depend on its batch-mates",
    )
    torch_threads: int = Field(
        0, ge=0,
        description="torch intra-op CPU threads (0: torch's choice, one per core). On a CPU shared with other "
        "busy processes, fewer threads avoid stalls at torch's spinning barriers (see bench/results/serve_cpu*.json)",
    )
    instances: int = Field(
        1, ge=1, le=64,
        description="serving processes (model instances, Triton's instance_group count) behind the one port: they "
        "share one copy of the layer's weights (see --share-weights), and each runs its own event loop, batcher, "
        "workspaces and CUDA graphs; new connections go to the ready instance with the fewest open ones. "
        "Readiness is 200 while every instance is ready. An instance that exits, hangs (no heartbeat) or whose "
        "device fails gets no connections and is restarted (see --instance-restarts); SIGTERM drains every "
        "instance. Not with torchrun (expert-parallel serving is one process per rank)",
    )
    share_weights: bool = Field(
        True, description="with --instances N > 1: one process (the weights process) loads and prepares the layer "
        "once and the instances map its tensors (CUDA IPC on a GPU, shared memory on the CPU): the device holds one "
        "copy of the weights plus each instance's workspaces. Off: every instance loads its own copy (N times the "
        "memory). On the CPU the shared copy lives in /dev/shm, which needs room for it (docker: --shm-size)",
    )
    tp: int = Field(
        1, ge=1,
        description="under torchrun (python -m megamoe.service.distributed): tensor parallelism over the job's N "
        "ranks, N = the number of processes: every rank holds 1/N of every expert's intermediate dimension and "
        "runs every token; 1: expert parallelism (each rank holds E/N whole experts). A single-process server "
        "serves the whole layer",
    )
    instance_heartbeat_timeout_s: float = Field(
        10.0, gt=0, description="with --instances: an instance whose event loop sent no heartbeat for this long is "
        "hung: it is killed and restarted (it gets no new connections after 3 s of silence already)",
    )
    instance_restarts: int = Field(
        3, ge=0, description="with --instances: how often one instance that failed (exited, hung, or left after a "
        "device error) is restarted within 10 minutes; once more, the server goes unready, drains the other "
        "instances and exits 1 (0: never restarted)",
    )
    hidden_datatype: str = Field(
        "FP32", pattern=f"^({'|'.join(HIDDEN_DATATYPES)})$",
        description="datatype of hidden_states and output in the model metadata and config (FP32 or BF16). Every "
        "request may send BF16, FP16 or FP32 regardless and is answered in its own hidden_states datatype; the "
        "advertised one is what clients that follow the metadata send (perf_analyzer). BF16 halves the bytes of "
        "both tensors (the kernels read bf16 activations); perf_analyzer's and tritonclient's JSON formats "
        "refuse BF16, so JSON clients need FP32",
    )
    host: str = Field("127.0.0.1", description="address to listen on (0.0.0.0 inside a container)")
    port: int = Field(8000, ge=0, le=65535, description="TCP port (0: any free port)")
    token: BearerToken | None = Field(
        None, description="bearer token required by the infer and kernel-health endpoints: visible ASCII, no "
        "spaces; unset or empty: no authentication (and no full kernel health). Prefer the env var, flags show "
        "in the process list"
    )
    max_body_bytes: int = Field(
        256 * 1024 * 1024, gt=0,
        description="largest request body accepted, larger ones get 413 (4096 x 7168 FP32 in binary is 117 MB)",
    )
    max_json_body_bytes: int = Field(
        64 * 1024 * 1024, gt=0,
        description="largest JSON body (or JSON header of a binary body) accepted, larger ones get 413; a JSON "
        "body also may not hold more numbers than the model takes in one request (400, while it arrives)",
    )
    timeout_keep_alive_s: float = Field(
        5.0, gt=0, description="an idle connection (after a response, or one that never sent a byte) is closed "
        "after this long",
    )
    timeout_request_head_s: float = Field(
        10.0, gt=0, description="a request line and headers must arrive within this long of their first byte, "
        "else the connection is closed",
    )
    timeout_write_s: float = Field(
        30.0, gt=0, description="a response the client does not read for this long (the connection's send "
        "buffer stays full) ends the connection, freeing what the response holds",
    )
    timeout_body_s: float = Field(
        60.0, gt=0, description="an infer request's body must arrive within this long of its headers, else 408",
    )
    max_tokens_per_request: int = Field(4096, gt=0, description="largest T (rows of hidden_states) in one request")
    max_batch_tokens: int = Field(8192, gt=0, description="largest number of tokens the batcher puts in one forward")
    queue_delay_ms: float = Field(
        2.0, ge=0, description="how long the batcher waits for more requests after the first one arrives"
    )
    selftest_level: str = Field("quick", pattern="^(quick|full|off)$", description="kernel self-test run before ready (quick, full, off)")
    selftest_interval_s: float = Field(
        0.0, ge=0, description="re-run the quick self-test this often while serving; a failure turns readiness to 503 (0: never)"
    )
    graceful_shutdown_s: float = Field(
        30.0, gt=0, description="on SIGTERM, how long requests in flight may take to finish; a body still "
        "arriving then gets 503",
    )
    log_level: str = Field("info", description="uvicorn log level")

    @field_validator("checkpoint", "layer", "model_name", "device", mode="before")
    @classmethod
    def _empty_is_unset(cls, value):
        # compose passes ``${VAR:-}`` as an empty string: treat it as not given
        return None if isinstance(value, str) and not value.strip() else value

    @field_validator("token", mode="before")
    @classmethod
    def _token_is_usable(cls, value):
        if isinstance(value, SecretStr):
            value = value.get_secret_value()
        if value is None or value == "":
            return None  # not given (compose's ``${MEGAMOE_TOKEN:-}``): no authentication
        if not isinstance(value, str):
            raise ValueError("the token must be a string")
        if not value.strip():
            raise ValueError("the token is only whitespace: that would turn authentication off silently; set a "
                             "real token, or leave MEGAMOE_TOKEN empty or unset for no authentication")
        bad = next((c for c in value if not 0x21 <= ord(c) <= 0x7E), None)
        if bad is not None:
            kind = "whitespace" if bad.isspace() else "a non-ASCII character" if ord(bad) > 0x7E else "a control character"
            raise ValueError(f"the token contains {kind}: a bearer token is visible ASCII without spaces "
                             "(RFC 6750), which every HTTP client can send")
        return value

    @model_validator(mode="after")
    def _batch_holds_a_request(self) -> "ServiceSettings":
        if self.max_batch_tokens < self.max_tokens_per_request:
            raise ValueError(
                f"max_batch_tokens ({self.max_batch_tokens}) must be >= max_tokens_per_request "
                f"({self.max_tokens_per_request}): one request has to fit in one batch"
            )
        return self

    def served_model_name(self) -> str:
        """The model's name in the URL: ``model_name``, else the preset's, the checkpoint folder's,
        or the checkpoint file's without its ``.safetensors`` suffix."""
        if self.model_name:
            return self.model_name
        if self.checkpoint:
            path = Path(self.checkpoint).resolve()
            return (path.stem if path.suffix == ".safetensors" else path.name) or "megamoe"
        return self.preset

    def token_value(self) -> str | None:
        return self.token.get_secret_value() if self.token is not None else None


def configure_logging(settings: ServiceSettings, instance: int | str | None = None) -> None:
    """The service's log format at its level; an instance of several names itself in every line (its
    index; a word: another process of the server, e.g. ``weights``)."""
    import logging

    where = "" if instance is None else f"[{instance}] " if isinstance(instance, str) else f"[instance {instance}] "
    logging.basicConfig(level=settings.log_level.upper(),
                        format=f"%(asctime)s %(levelname)s {where}%(name)s: %(message)s")


def parse_settings(argv: list[str] | None) -> ServiceSettings:
    """Settings from the environment, overridden by ``argv`` flags (``--help`` prints them and exits)."""
    return ServiceSettings(_cli_parse_args=list(argv) if argv is not None else [])
