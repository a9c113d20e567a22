"""The front-ends that import a training framework: the Lightning Trainer callback, Lightning Fabric, the Hugging Face
Trainer, and the env-var ``callbacks_factory`` entry points."""
