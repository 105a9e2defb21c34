"""Service configuration: environment variables ``MEGAMOE_*`` and ``megamoe serve`` flags.

Every field is both an env var (``MEGAMOE_QUEUE_DELAY_MS``) and a flag
(``--queue-delay-ms``); a flag wins over the environment.
"""

from __future__ import annotations

from pydantic import Field, SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict


class ServiceSettings(BaseSettings):
    model_config = SettingsConfigDict(
        env_prefix="MEGAMOE_",
        cli_prog_name="megamoe serve",
        cli_kebab_case=True,
        cli_implicit_flags=True,
        extra="ignore",
    )

    checkpoint: str | None = Field(
        None, description="ModelOpt NVFP4 MoE checkpoint directory to serve; when unset a synthetic preset is served"
    )
    preset: str = Field("small", description="synthetic preset served when no checkpoint is given (tiny, small, v4-flash, v3)")
    seed: int = Field(0, description="seed of the synthetic preset's weights")
    model_name: str | None = Field(
        None, description="model name in the URL (/v2/models/<name>); default: the preset name or the checkpoint folder's name"
    )
    backend: str = Field(
        "auto",
        description="kernel backend: auto, torch, cuda-sm90, cuda-sm100, or 'package.module:attr' (a Backend subclass or factory)",
    )
    device: str | None = Field(None, description="torch device for the weights (default: the backend's)")
    torch_threads: int = Field(
        0, ge=0,
        description="torch intra-op CPU threads (0: torch's default, one per core). On a CPU shared with other "
        "busy processes, fewer threads avoid stalls at torch's spinning barriers (see bench/results/serve_cpu*.json)",
    )
    host: str = Field("127.0.0.1", description="address to listen on (0.0.0.0 inside a container)")
    port: int = Field(8000, ge=0, le=65535, description="TCP port (0: any free port)")
    token: SecretStr | None = Field(
        None, description="bearer token required by the infer and kernel-health endpoints (unset: no authentication; "
        "prefer the env var MEGAMOE_TOKEN, flags show in the process list)"
    )
    max_body_bytes: int = Field(
        256 * 1024 * 1024, gt=0,
        description="largest request body accepted, larger ones get 413 (4096 x 7168 FP32 in binary is 117 MB)",
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
    graceful_shutdown_s: float = Field(30.0, gt=0, description="on SIGTERM, how long in-flight requests may take to finish")
    log_level: str = Field("info", description="uvicorn log level")

    @field_validator("checkpoint", "model_name", "device", "token", mode="before")
    @classmethod
    def _empty_is_unset(cls, value):
        # compose passes ``${VAR:-}`` as an empty string: treat it as not given
        return None if isinstance(value, str) and not value.strip() else value

    @model_validator(mode="after")
    def _batch_holds_a_request(self) -> "ServiceSettings":
        if self.max_batch_tokens < self.max_tokens_per_request:
            raise ValueError(
                f"max_batch_tokens ({self.max_batch_tokens}) must be >= max_tokens_per_request "
                f"({self.max_tokens_per_request}): one request has to fit in one batch"
            )
        return self

    def token_value(self) -> str | None:
        return self.token.get_secret_value() if self.token is not None else None


def parse_settings(argv: list[str] | None) -> ServiceSettings:
    """Settings from the environment, overridden by ``argv`` flags (``--help`` prints them and exits)."""
    return ServiceSettings(_cli_parse_args=list(argv) if argv is not None else [])
