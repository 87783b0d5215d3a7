"""Fine-tuning with Accelerate: configuration, memory estimate, the loop, checkpoints, distillation."""
