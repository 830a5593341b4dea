"""`preprocessing` and `postprocessing`: stateless, dynamically batched Python models around the tokenizer.

* preprocessing: `text_input` -> `input_ids` (the engine's tokenization: no special tokens added).
* postprocessing: one `ouro_engine` response -> the client tensors. Detokenization is incremental and
  stateless: `decode(prefix_ids + output_ids) - decode(prefix_ids)`, holding back an incomplete UTF-8
  character until a later response completes it (protocol.detokenize), so any instance can serve any
  response and a stream's deltas concatenate to exactly the one-shot text. Multi-instance deployments must
  keep `dynamic_batching { preserve_ordering: true }` or an ensemble reorders a stream's deltas.

The tokenizer comes from the same checkpoint as the engine: $OURO_MODEL_PATH, else the `model` parameter
of the model's config.pbtxt ($OURO_ENGINE_ARGS may set it too), else the demo model.
"""

from __future__ import annotations

import abc
import json
import logging

from ..config import ConfigError
from ..sampling_params import RequestError
from . import protocol
from .options import engine_options, resolve_model_path, tensor_arrays

log = logging.getLogger(__name__)


class _TokenizerModel(abc.ABC):
    input_specs: dict = {}

    def initialize(self, args: dict) -> None:
        import triton_python_backend_utils as pb_utils

        self.pb = pb_utils
        self.model_config = json.loads(args["model_config"])
        self.model_name = args.get("model_name", type(self).__name__)
        options, _ = engine_options(self.model_config, args.get("model_repository"))
        try:
            path = resolve_model_path({"model": options.get("model", "")})["model"]
            from ..model.tokenizer import load_tokenizer

            self.tokenizer = load_tokenizer(path)
            self.model_path = path
        except ConfigError as e:
            raise pb_utils.TritonModelException(f"{self.model_name}: {e}") from None
        pb_utils.Logger.log_info(f"{self.model_name}: tokenizer from {path}")

    def execute(self, requests: list) -> list:
        pb = self.pb
        responses = []
        for request in requests:
            try:
                arrays = self.process(tensor_arrays(request.inputs(), self.input_specs), request)
                responses.append(pb.InferenceResponse(output_tensors=[pb.Tensor(k, v) for k, v in arrays.items()]))
            except RequestError as e:
                responses.append(
                    pb.InferenceResponse(
                        output_tensors=[], error=pb.TritonError(f"{self.model_name}: invalid request: {e}")
                    )
                )
            except Exception as e:
                log.exception("%s failed", self.model_name)
                responses.append(
                    pb.InferenceResponse(
                        output_tensors=[], error=pb.TritonError(f"{self.model_name}: {type(e).__name__}: {e}")
                    )
                )
        return responses

    @abc.abstractmethod
    def process(self, inputs: dict, request) -> dict:
        """One request's input arrays -> its output arrays."""

    def finalize(self) -> None:
        pass


class PreprocessingModel(_TokenizerModel):
    """Takes every client input (all optional), so that in the ensemble it always runs and validates the
    whole request before the engine sees it: without that, a request lacking `text_input` but carrying
    another input would pass Triton's input-count check and the ensemble would end with no response data."""

    input_specs = protocol.CLIENT_INPUTS

    def initialize(self, args: dict) -> None:
        super().initialize(args)
        from ..model.checkpoint import load_config

        # The checkpoint's positions bound every engine's context (max_model_len <= max_position_embeddings).
        context = load_config(self.model_path).max_position_embeddings
        self.prompt_limit = (protocol.prompt_byte_limit(self.tokenizer, context), context)

    def process(self, inputs: dict, request) -> dict:
        # An unknown /generate JSON field arrives as a request parameter: reject it here so the ensemble
        # fails fast with a clear message (the `ouro` front checks its own request).
        protocol.check_parameters(request.parameters())
        protocol.check_prompt_bytes(inputs, "text_input", *self.prompt_limit)
        parsed = protocol.parse_request(inputs, specs=protocol.CLIENT_INPUTS)
        assert isinstance(parsed.prompt, str)  # text_input
        return protocol.tokenize_arrays(self.tokenizer, parsed.prompt)


class PostprocessingModel(_TokenizerModel):
    input_specs = protocol.POST_INPUTS

    def process(self, inputs: dict, request) -> dict:
        return protocol.postprocess_arrays(self.tokenizer, inputs)
