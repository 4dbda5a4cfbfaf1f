"""The base layer, imported by everything above it and importing nothing of specmoe:
errors, units (sizes and rates), paths (demo model, cache dir, state files), config
(ModelConfig from config.json, EngineConfig with every option check), checkpoint (lazy
safetensors), tokenizer, prompts files and the trace format."""
