"""Files in and out: loading checkpoints (dtype, device map), atomic writes, aligned safetensors, paths."""
