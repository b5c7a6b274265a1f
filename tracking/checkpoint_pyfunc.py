"""The MLflow pyfunc model of a transformers checkpoint folder, logged as MLflow "models from code":
MLflow copies this file into the logged model and runs it when the model is loaded, so loading it
needs mlflow, torch and transformers, not featcal (this file imports nothing of featcal).

`mlflow.pyfunc.load_model(uri)` reads the folder (the model's `checkpoint` artifact) with
`from_pretrained` of the class its config.json names (`architectures[0]`; else AutoModel), in
eval mode; `.unwrap_python_model().model` is that transformers model. `predict` takes a mapping of
the forward's inputs (name → array or nested list: `input_ids` (batch, tokens) integers,
`attention_mask`, `pixel_values` (batch, 3, height, width) floats, ...) and returns the output's
tensor fields (name → numpy array: `logits`, `last_hidden_state`, `pooler_output`, ...; bfloat16
as float32), computed without gradients on the model's device.
"""

import json
from pathlib import Path

import mlflow
from mlflow.pyfunc import PythonModel

#: the name of the checkpoint folder among the model's artifacts
CHECKPOINT_ARTIFACT = "checkpoint"


class CheckpointModel(PythonModel):
    """A transformers checkpoint folder behind MLflow's pyfunc interface."""

    # its input is a mapping of tensors, which MLflow's type-hint validation cannot describe:
    # predict takes it as given (MLflow's switch for such models; no warning at each load)
    _skip_type_hint_validation = True

    def load_context(self, context):
        import transformers

        folder = Path(context.artifacts[CHECKPOINT_ARTIFACT])
        config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
        names = config.get("architectures") or []
        loader = getattr(transformers, names[0], None) if names else None
        if not hasattr(loader, "from_pretrained"):
            loader = transformers.AutoModel
        self.model = loader.from_pretrained(folder).eval()

    def predict(self, context, model_input, params=None):
        import torch

        device = next(self.model.parameters()).device
        inputs = {name: torch.as_tensor(value).to(device) for name, value in model_input.items()}
        with torch.no_grad():
            output = self.model(**inputs)
        fields = {}
        for name, value in output.items():
            if isinstance(value, torch.Tensor):
                value = value.detach().cpu()
                if value.dtype == torch.bfloat16:
                    value = value.float()
                fields[name] = value.numpy()
        return fields


mlflow.models.set_model(CheckpointModel())
