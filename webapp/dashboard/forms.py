from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from django import forms
from django.contrib.auth import get_user_model
from django.contrib.auth.forms import UserCreationForm
from django.utils.html import format_html, format_html_join

from rl_core.config import ConfigError, RunConfig


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

    def __init__(self, *args, runs=(), **kwargs):
        super().__init__(*args, **kwargs)
        self.fields["run"].choices = [("", "— none yet —")] + [(str(r.id), r.name) for r in runs]


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
    inference pools a LoRA run may attach to (``inference_pool`` becomes a select of them).
    ``checkpoints``: the project's, which ``init_checkpoint`` offers by id.
    """

    name = forms.CharField(max_length=200)
    dataset = forms.ChoiceField(required=False, help_text="Required in dataset mode.")

    def __init__(self, *args, datasets=(), models=(), pools=(), checkpoints=(), **kwargs):
        super().__init__(*args, **kwargs)
        self.fields["dataset"].choices = [("", "— none —")] + [
            (str(d.id), f"{d.name} ({d.row_count} rows)") for d in datasets
        ]
        for spec in RunConfig.field_specs():
            self.fields[spec.name] = _form_field(spec)
        self.fields["reward"].initial = '{"type": "exact_match"}'
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
        if names:
            base_model.help_text += " Pick one this instance knows, or type another."

    def basic_fields(self):
        """The fields shown open: name, dataset and every setting not marked advanced."""
        advanced = self._advanced_names()
        return [self[name] for name in self.fields if name not in advanced]

    def advanced_fields(self):
        """Trainer scale, precision and LoRA settings: folded away under "Advanced"."""
        advanced = self._advanced_names()
        return [self[name] for name in self.fields if name in advanced]

    def advanced_has_errors(self) -> bool:
        return any(field.errors for field in self.advanced_fields())

    @staticmethod
    def _advanced_names() -> set[str]:
        return {spec.name for spec in RunConfig.field_specs() if spec.metadata.get("advanced")}

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
