"""What a run's settings may make the server read, import and call: one set of rules per instance.

Steep is multi-tenant: projects share the instance's disks, workers and network. A run's
settings name things the server itself then opens (``base_model``), imports and calls (a
``python`` reward's ``path``) or sends requests to (a judge's ``base_url``). Each is checked
here against the operator's rules (``SourceRules``, built by the web app from its settings and
handed to a run's Ray job in its config), at every door: run creation (REST, dashboard, clone),
the launch of the run's job, and the job's own start, so a config written before these rules
is refused when it runs, before anything is read or imported.

- Models come from known places: the instance's demo model, or a directory under one of the
  operator's model roots (a bare name is looked up in each), never a checkpoint directory
  (those are named by id in ``init_checkpoint``); a Hugging Face id only where the operator
  allows hub models.
- Reward code the operator allowed: Steep's own ``*_reward_fn`` functions, and functions of the
  modules the operator lists (by prefix); nothing else is imported.
- Outbound URLs a tenant names are resolved and refused when any address they resolve to is
  not global (loopback, link-local such as a cloud's metadata address, private, reserved) or
  is one of the instance's own, unless the operator allowed that network or host. Requests
  to them go through ``screened_client``, which checks every request again when it is sent
  (a name that resolved elsewhere since) and follows no redirect.

No Django, no torch.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import os
import re
import socket
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

# Steep's own reward functions: a python reward may always name these.
BUILTIN_REWARD_MODULES = ("rl_core.rewards", "rl_core.toy")
_HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*$")

Resolver = Callable[[str], list[str]]


class SourceRefused(ValueError):
    """A setting names something the instance's rules refuse; ``setting`` is its name."""

    def __init__(self, setting: str, message: str):
        self.setting = setting
        super().__init__(message)


@dataclass(frozen=True)
class SourceRules:
    """The operator's rules for what runs may name (webapp.runs.sources builds them from settings)."""

    model_roots: tuple[str, ...] = ()
    """Directories whose sub-directories are models a run may train (STEEP_MODEL_ROOTS)."""
    offered_models: tuple[str, ...] = ()
    """Models offered by name as they are (the demo model)."""
    hub_models: bool = False
    """A Hugging Face id (``org/name``) is accepted as base_model (STEEP_HUB_MODELS)."""
    private_dirs: tuple[str, ...] = ()
    """Directories no base_model may be in, whatever the roots say: the runs' checkpoints."""
    reward_modules: tuple[str, ...] = ()
    """Module prefixes whose functions a python reward may name (STEEP_REWARD_MODULES)."""
    outbound_allow: tuple[str, ...] = ()
    """Networks (CIDR) and host names an outbound URL may reach although not global
    (STEEP_OUTBOUND_ALLOW)."""
    own_hosts: tuple[str, ...] = ()
    """The instance's own host names and addresses: refused as outbound targets unless allowed."""
    unrestricted: bool = False
    """An operator's explicit bypass (a management command's flag): nothing is refused."""

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> SourceRules:
        names = {f.name: f for f in dataclasses.fields(cls)}
        values: dict[str, Any] = {
            k: tuple(v) if isinstance(v, list) else v for k, v in data.items() if k in names
        }
        return cls(**values)


# -- models -------------------------------------------------------------------------------


def _inside(path: Path, root: Path) -> bool:
    return path == root or root in path.parents


def _real(path: str | Path) -> Path:
    return Path(os.path.realpath(os.path.expanduser(str(path))))


def models_offered_text(rules: SourceRules) -> str:
    roots = ", ".join(rules.model_roots) or "none"
    hub = (
        "Hugging Face ids (org/name) are allowed"
        if rules.hub_models
        else "Hugging Face ids are not allowed on this instance (STEEP_HUB_MODELS)"
    )
    return (
        f"Models may come from GET /api/v1/models/ (the demo model and the model directories"
        f" the operator provides) or a directory under the model roots ({roots}:"
        f" STEEP_MODEL_ROOTS); {hub}."
    )


def model_source(name: str, rules: SourceRules) -> str:
    """``name`` as the server will load it (an absolute directory, or a Hugging Face id), or
    ``SourceRefused`` naming ``base_model`` and where models may come from."""
    name = name.strip()
    if rules.unrestricted or name in rules.offered_models:
        return name
    private = [_real(d) for d in rules.private_dirs]
    roots = [_real(r) for r in rules.model_roots]

    def refuse(why: str) -> SourceRefused:
        return SourceRefused("base_model", f"{why} {models_offered_text(rules)}")

    def allowed_dir(path: Path) -> str | None:
        real = _real(path)
        if any(_inside(real, p) for p in private):
            raise refuse(
                f"base_model {name!r} is a run's checkpoint, not a model: start from a"
                " checkpoint of your project with init_checkpoint (its id)."
            )
        if any(_inside(real, root) and real != root for root in roots) and real.is_dir():
            return str(real)
        return None

    if os.path.isabs(name) or name.startswith(("~", ".")):
        found = allowed_dir(Path(name))
        if found is None:
            raise refuse(f"base_model {name!r} is not a model directory this instance offers.")
        return found
    if ".." not in Path(name).parts:
        for root in roots:  # a bare name: a model directory in one of the roots
            if (root / name).is_dir() and (found := allowed_dir(root / name)):
                return found
    if _HUB_ID.match(name) and ".." not in name and rules.hub_models:
        if os.path.lexists(name):  # transformers would read this relative path, not the hub
            raise refuse(f"base_model {name!r} names a path here, not a Hugging Face id.")
        return name
    raise refuse(f"base_model {name!r} is not a model this instance offers.")


# -- reward code --------------------------------------------------------------------------


def reward_source_errors(spec: Any, rules: SourceRules) -> list[str]:
    """Why a ``python`` reward's function may not be imported here (empty: it may)."""
    if rules.unrestricted or not isinstance(spec, dict) or spec.get("type") != "python":
        return []
    path = spec.get("path")
    if not isinstance(path, str):
        return []  # the spec's own check says what a path looks like
    module, _, function = path.partition(":")
    if module in BUILTIN_REWARD_MODULES and function.endswith("_reward_fn"):
        return []
    if not function.startswith("_") and any(
        module == prefix or module.startswith(prefix + ".") for prefix in rules.reward_modules
    ):
        return []
    listed = ", ".join(rules.reward_modules) or "none"
    return [
        f"reward.path {path!r} is not reward code this instance allows: a python reward may name"
        f" Steep's own reward functions ({', '.join(BUILTIN_REWARD_MODULES)}, *_reward_fn) or"
        f" functions of the modules the operator lists in STEEP_REWARD_MODULES ({listed});"
        " or use a built-in reward type (exact_match, regex, math, judge, human)."
    ]


# -- outbound URLs ------------------------------------------------------------------------


def system_resolver(host: str) -> list[str]:
    """Every address ``host`` resolves to (the system resolver)."""
    return sorted({str(info[4][0]) for info in socket.getaddrinfo(host, None)})


def _address(text: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    try:
        address = ipaddress.ip_address(text.split("%", 1)[0])
    except ValueError:
        return None
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped:
        return address.ipv4_mapped
    return address


def _allowed(host: str, address, rules: SourceRules) -> bool:
    for entry in rules.outbound_allow:
        if "/" in entry or _address(entry) is not None:
            if address is not None and address in ipaddress.ip_network(entry, strict=False):
                return True
        elif host.lower().rstrip(".") == entry.lower().rstrip("."):
            return True
    return False


def host_errors(
    host: str, rules: SourceRules, *, setting: str, resolve: Resolver | None = None
) -> list[str]:
    """Why requests to ``host`` are refused (empty: allowed)."""
    if rules.unrestricted:
        return []
    host = host.strip("[]")
    literal = _address(host)
    try:
        addresses = [host] if literal is not None else (resolve or system_resolver)(host)
    except OSError as exc:
        return [f"{setting}: the host {host!r} cannot be resolved ({exc})."]
    own = {h.lower().strip("[]") for h in rules.own_hosts}
    for text in addresses:
        address = _address(text)
        if address is None:
            return [f"{setting}: the host {host!r} resolved to {text!r}, not an address."]
        if _allowed(host, address, rules):
            continue
        where = f"{host!r}" + ("" if literal is not None else f" (resolves to {text})")
        if host.lower() in own or str(address) in own:
            return [
                f"{setting}: {where} is this Steep instance itself; requests from the server"
                " to its own addresses are refused unless the operator allows them"
                " (STEEP_OUTBOUND_ALLOW)."
            ]
        if not address.is_global:
            kind = (
                "loopback"
                if address.is_loopback
                else "link-local (e.g. a cloud's metadata service)"
                if address.is_link_local
                else "private"
                if address.is_private
                else "reserved"
            )
            return [
                f"{setting}: {where} is a {kind} address; the server does not send requests"
                " there unless the operator allows that network or host"
                " (STEEP_OUTBOUND_ALLOW)."
            ]
    return []


def url_errors(
    url: Any, rules: SourceRules, *, setting: str, resolve: Resolver | None = None
) -> list[str]:
    """Why the server may not send requests to ``url`` (empty: it may)."""
    if rules.unrestricted or not isinstance(url, str):
        return []
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        return [f"{setting}: {url!r} is not an http(s) URL with a host."]
    return host_errors(parts.hostname, rules, setting=setting, resolve=resolve)


def screened_client(
    rules: SourceRules, *, setting: str, resolve: Resolver | None = None, **client_kwargs: Any
):
    """An ``httpx.Client`` that checks every request's host against ``rules`` as it is sent
    (raising ``httpx.ConnectError``, whose message names the setting) and follows no redirect:
    a 3xx is the answer, so a redirect cannot lead past the screen."""
    import httpx

    class Screen(httpx.HTTPTransport):
        def handle_request(self, request: httpx.Request) -> httpx.Response:
            errors = host_errors(request.url.host, rules, setting=setting, resolve=resolve)
            if errors:
                raise httpx.ConnectError(errors[0], request=request)
            return super().handle_request(request)

    return httpx.Client(transport=Screen(), follow_redirects=False, **client_kwargs)


def screened_async_client(
    rules: SourceRules, *, setting: str, resolve: Resolver | None = None, **client_kwargs: Any
):
    """``screened_client`` for asyncio: an ``httpx.AsyncClient`` that checks every request."""
    import httpx

    class Screen(httpx.AsyncHTTPTransport):
        async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
            errors = host_errors(request.url.host, rules, setting=setting, resolve=resolve)
            if errors:
                raise httpx.ConnectError(errors[0], request=request)
            return await super().handle_async_request(request)

    return httpx.AsyncClient(transport=Screen(), follow_redirects=False, **client_kwargs)


# -- a whole config -----------------------------------------------------------------------


def outbound_urls(config: Any) -> Iterable[tuple[str, Any]]:
    """The URLs a run's settings make the server call, with the setting that names each."""
    reward = getattr(config, "reward", None)
    if isinstance(reward, dict) and reward.get("type") == "judge" and "base_url" in reward:
        yield "reward.base_url", reward["base_url"]
    if getattr(config, "teacher_url", ""):  # on-policy distillation's teacher (rl_core.distill)
        yield "teacher_url", config.teacher_url


def tokenizer_source(path: str, rules: SourceRules, setting: str = "teacher_tokenizer") -> str:
    """A tokenizer directory the job may read (a model's, as ``model_source`` allows them), or
    ``SourceRefused`` naming ``setting``."""
    try:
        return model_source(path, rules)
    except SourceRefused:
        raise SourceRefused(
            setting,
            f"{setting} {path!r} is not a model directory this instance offers: "
            f"{models_offered_text(rules)}",
        ) from None


def config_source_errors(
    config: Any, rules: SourceRules, *, resolve: Resolver | None = None
) -> dict[str, list[str]]:
    """Every setting of ``config`` (a ``RunConfig``) that names what ``rules`` refuse."""
    errors: dict[str, list[str]] = {}
    try:
        model_source(config.base_model, rules)
    except SourceRefused as exc:
        errors.setdefault(exc.setting, []).append(str(exc))
    if messages := reward_source_errors(config.reward, rules):
        errors.setdefault("reward", []).extend(messages)
    if getattr(config, "teacher_tokenizer", ""):
        try:
            tokenizer_source(config.teacher_tokenizer, rules)
        except SourceRefused as exc:
            errors.setdefault(exc.setting, []).append(str(exc))
    for setting, url in outbound_urls(config):
        if messages := url_errors(url, rules, setting=setting, resolve=resolve):
            errors.setdefault(setting.split(".")[0], []).extend(messages)
    return errors


def errors_text(errors: dict[str, list[str]]) -> str:
    """``errors`` as one line: what a run that failed to start says."""
    return "; ".join(f"{name}: {' '.join(messages)}" for name, messages in errors.items())
