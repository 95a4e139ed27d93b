"""Draft training pipeline: prompts, regenerated data, features, draft vocabulary, training-time test."""
