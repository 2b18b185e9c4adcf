"""Go's own `text/template` (what Ollama runs), to render an exported Modelfile's TEMPLATE in the tests."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

GO_TEMPLATE_RENDERER = r"""package main

import (
	"encoding/json"
	"os"
	"text/template"
)

// Ollama's chat data: template.Execute passes {"System", "Messages"} with messages of Role and Content.
type Message struct {
	Role    string `json:"role"`
	Content string `json:"content"`
}

func main() {
	var input struct {
		Template string     `json:"template"`
		System   string     `json:"system"`
		Messages []*Message `json:"messages"`
	}
	if err := json.NewDecoder(os.Stdin).Decode(&input); err != nil {
		panic(err)
	}
	t := template.Must(template.New("").Parse(input.Template))
	if err := t.Execute(os.Stdout, map[string]any{"System": input.System, "Messages": input.Messages}); err != nil {
		panic(err)
	}
}
"""


def render_with_go(template: str, messages: list[dict], system: str, work_dir: Path) -> str:
    """Render an Ollama TEMPLATE with Go's own text/template (what Ollama runs), on messages already
    collated as Ollama collates them; needs the `go` toolchain (Debian's golang-go)."""
    source = Path(work_dir) / "render.go"
    source.write_text(GO_TEMPLATE_RENDERER)
    payload = json.dumps({"template": template, "system": system, "messages": messages})
    env = {**os.environ, "GOCACHE": str(Path(work_dir) / "gocache"), "GO111MODULE": "off"}
    done = subprocess.run(
        ["go", "run", str(source)], input=payload, capture_output=True, text=True, env=env, timeout=300
    )
    if done.returncode:
        raise RuntimeError(f"go run failed: {done.stderr}")
    return done.stdout
