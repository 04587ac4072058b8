"""A stand-in for an autoregressive decoder: it "generates" the words of a fixed reply to
the prompt, one token per step, with a delay per step. ``generate`` is a generator; each
``yield`` is one response, sent to the client as it is produced."""

import time

import numpy as np

from gpuserve import PythonModel

REPLY = "streaming responses arrive one token at a time, as the model produces them"


class Model(PythonModel):
    def load(self, context):
        self.step_s = float(context.parameters.get("seconds_per_token", 0.02))

    def generate(self, inputs):
        prompt = inputs["PROMPT"].reshape(-1)[0].decode()
        limit = inputs.get("MAX_TOKENS")
        words = [f"{prompt}:", *REPLY.split()]
        if limit is not None:
            words = words[: int(limit.reshape(-1)[0])]
        for index, word in enumerate(words):
            time.sleep(self.step_s)  # the decoder step
            yield {
                "TOKEN": np.array([word.encode()], dtype=object),
                "INDEX": np.array([index], dtype=np.int32),
            }
