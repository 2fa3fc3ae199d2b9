from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from django import forms
from django.conf import settings
from django.contrib.auth import get_user_model
from django.contrib.auth.forms import UserCreationForm
from django.utils.html import escape, format_html, format_html_join

from rl_core.config import ConfigError, RunConfig
from rl_core.config_groups import POOL_SETTINGS, SETTING_GROUPS


class SignupForm(UserCreationForm):
    class Meta:
        model = get_user_model()
        fields = ["username"]


class ProjectForm(forms.Form):
    name = forms.CharField(max_length=100)


class KeyForm(forms.Form):
    name = forms.CharField(
        max_length=100, required=False, help_text="A label, e.g. the agent or machine using it."
    )


class DatasetForm(forms.Form):
    name = forms.CharField(max_length=200)
    file = forms.FileField(
        help_text='JSONL, one {"prompt": ...} or {"messages": [...]} per line; optional "answer", "metadata". '
        "A run's trajectory export (JSONL or Parquet) works too: replay or SFT data."
    )


class AgentForm(forms.Form):
    name = forms.CharField(max_length=200)
    run = forms.ChoiceField(required=False, help_text="The run whose policy answers this agent.")
    role = forms.ChoiceField(
        required=False,
        help_text='A multi-agent run: the role this agent plays (its requests may also send model "policy/<role>").',
    )

    def __init__(self, *args, runs=(), **kwargs):
        super().__init__(*args, **kwargs)
        self.fields["run"].choices = [("", "— none yet —")] + [(str(r.id), r.name) for r in runs]
        # The roles of the runs that have them, grouped by run; the service checks the pair.
        grouped = [
            (r.name, [(role, role) for role in (r.config or {}).get("roles") or []]) for r in runs
        ]
        grouped = [group for group in grouped if group[1]]
        if grouped:
            self.fields["role"].choices = [("", "— none —"), *grouped]
        else:
            del self.fields["role"]


def _form_field(spec) -> forms.Field:
    """A form field for one RunConfig setting: widget and help from the dataclass; validation stays there."""
    kind = spec.type if isinstance(spec.type, str) else spec.type.__name__
    default = None if spec.default is dataclasses.MISSING else spec.default
    help_text = spec.metadata["help"]
    required = bool(spec.metadata.get("required"))
    if spec.metadata.get("choices"):
        return forms.ChoiceField(
            choices=[(c, c) for c in spec.metadata["choices"]], initial=default, help_text=help_text
        )
    if kind == "bool":
        return forms.BooleanField(required=False, initial=default, help_text=help_text)
    if kind == "int":
        return forms.IntegerField(required=required, initial=default, help_text=help_text)
    if "float" in kind:
        return forms.FloatField(required=False, initial=default, help_text=help_text)
    if kind == "list":
        return forms.CharField(
            required=False,
            initial=", ".join(default or []),
            help_text=help_text + " Comma-separated here.",
            widget=forms.TextInput(attrs={"placeholder": "q_proj, v_proj"}),
        )
    if kind == "dict":
        return forms.CharField(
            required=False,
            initial="",
            help_text=help_text,
            widget=forms.TextInput(
                attrs={"placeholder": spec.metadata.get("placeholder", '{"type": "exact_match"}')}
            ),
        )
    return forms.CharField(required=required, initial=default, help_text=help_text)


def _initial(value):
    """A preset's setting as a field of this form takes it (lists comma-separated, objects as JSON)."""
    if isinstance(value, list):
        return ", ".join(value)
    if isinstance(value, dict):
        return json.dumps(value) if value else ""
    return value


def _base_model_help(*, listed: bool) -> str:
    """What this instance accepts as base_model (``rl_core.sources.model_source``), said plainly."""
    roots = escape(", ".join(settings.STEEP_MODEL_ROOTS) or "none")  # help text is rendered |safe
    hub = (
        "or a Hugging Face id (org/name), which the run's job downloads"
        if settings.STEEP_HUB_MODELS
        else "not a Hugging Face id: this instance does not download models (STEEP_HUB_MODELS)"
    )
    offered = "Pick one this instance offers from the list, or type" if listed else "Type"
    return (
        f"The model to train. {offered} the demo model ({escape(settings.STEEP_DEMO_MODEL)}), or the"
        f" name or path of a model directory (Hugging Face format) under a model root"
        f" (STEEP_MODEL_ROOTS: {roots}); {hub}."
    )


class DatalistInput(forms.TextInput):
    """A text input offering ``options`` (an HTML datalist): pick one or type another."""

    def __init__(self, options: list[str], list_id: str, attrs=None):
        super().__init__({**(attrs or {}), "list": list_id})
        self.options, self.list_id = options, list_id

    def render(self, name, value, attrs=None, renderer=None):
        items = format_html_join("", '<option value="{}"></option>', ((o,) for o in self.options))
        datalist = format_html('<datalist id="{}">{}</datalist>', self.list_id, items)
        return super().render(name, value, attrs, renderer) + datalist


class RunForm(forms.Form):
    """Built from RunConfig's fields; ``clean`` hands the values to RunConfig.from_dict, the one validator.

    ``models``: the base models to offer (``webapp.runs.selectors.known_models``); the
    project's newest, else the first (the demo model), is filled in. ``pools``: the shared
    inference pools a LoRA run may attach to (``inference_pool`` becomes a select of them,
    shown with ``lora_rank`` among the essentials). ``checkpoints``: the project's, which
    ``init_checkpoint`` offers by id. ``preset``: a ``RunPreset`` whose values fill the form.
    The sections are ``rl_core.config_groups``': the essentials open, the rest under Advanced.
    """

    name = forms.CharField(max_length=200)
    dataset = forms.ChoiceField(
        required=False,
        help_text="Dataset mode: the prompts Steep samples. Online mode needs none: your agents"
        " call the run's base_url.",
    )

    def __init__(
        self, *args, datasets=(), models=(), pools=(), checkpoints=(), preset=None, **kwargs
    ):
        super().__init__(*args, **kwargs)
        self.fields["dataset"].choices = [("", "— none —")] + [
            (str(d.id), f"{d.name} ({d.row_count} rows)") for d in datasets
        ]
        for spec in RunConfig.field_specs():
            self.fields[spec.name] = _form_field(spec)
        self.fields["reward"].initial = '{"type": "exact_match"}'
        self.essentials = ["name", "mode", "base_model", "dataset", "reward", "max_steps"]
        if pools:
            pool = self.fields["inference_pool"]
            self.fields["inference_pool"] = forms.ChoiceField(
                required=False,
                choices=[("", "— servers of the run's own —")]
                + [
                    (p.name, f"{p.name} ({Path(p.base_model).name or p.base_model}, {p.status})")
                    for p in pools
                ],
                help_text=pool.help_text + " Set lora_rank above 0 to attach.",
            )
            self.essentials += POOL_SETTINGS
        start = self.fields["init_checkpoint"]
        self.fields["init_checkpoint"] = forms.ChoiceField(
            required=False,
            choices=[("", "— base_model's weights —")]
            + [(str(c.pk), f"{c.run.name} · step {c.step} (id {c.pk})") for c in checkpoints],
            help_text=start.help_text,
        )
        names = [m.name for m in models]
        preferred = [m.name for m in models if m.source == "project"] or names
        base_model = self.fields["base_model"]
        base_model.widget = DatalistInput(names, "known-models")
        base_model.initial = preferred[0] if preferred else ""
        base_model.help_text = _base_model_help(listed=bool(names))
        self.defaults = {name: f.initial for name, f in self.fields.items() if name != "name"}
        if preset is not None:
            for name, value in preset.values.items():
                self.fields[name].initial = _initial(value)

    def essential_fields(self):
        """What a first run needs, shown open: name, mode, model, dataset, reward, steps (and a pool)."""
        return [self[name] for name in self.essentials]

    def advanced_groups(self) -> list[tuple[str, list]]:
        """The other settings by group (``rl_core.config_groups``), folded under Advanced."""
        return [
            (group, [self[n] for n in names if n not in self.essentials])
            for group, names in SETTING_GROUPS.items()
            if any(n not in self.essentials for n in names)
        ]

    def advanced_has_errors(self) -> bool:
        return any(f.errors for _, fields in self.advanced_groups() for f in fields)

    def preset_values(self, preset) -> dict[str, str | bool]:
        """Every field but the name as ``preset`` sets it (the defaults where it is silent), as
        the browser holds it: what ``static/run_form.js`` writes into the form."""
        values = {name: self.defaults[name] for name in self.defaults}
        values |= {name: _initial(value) for name, value in preset.values.items()}
        return {
            name: v if isinstance(v, bool) else "" if v is None else str(v)
            for name, v in values.items()
        }

    def clean(self):
        cleaned = super().clean()
        values = {}
        for spec in RunConfig.field_specs():
            if spec.name not in cleaned:
                continue
            value = cleaned[spec.name]
            if spec.type == "dict":  # reward, trackers: JSON objects
                try:
                    value = json.loads(value) if value else {}
                except ValueError:
                    example = spec.metadata.get("placeholder", '{"type": "exact_match"}')
                    self.add_error(spec.name, f"Enter a JSON object, e.g. {example}.")
                    continue
            if value is None and spec.default is not None and "None" not in str(spec.type):
                continue
            values[spec.name] = value
        if self.errors:
            return cleaned
        try:
            cleaned["config"] = RunConfig.from_dict(values)
        except ConfigError as exc:
            for field, messages in exc.errors.items():
                for message in messages:
                    self.add_error(field if field in self.fields else None, message)
        return cleaned
