"""An OpenAI-compatible HTTP endpoint over the inference engine: agents written against the `openai` client call the
policy being trained, and every token they get back is the engine's own sample, recorded token-exact."""
