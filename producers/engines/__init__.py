"""Generation engines a producer can run (`rollout.name`): `builtin` is the policy module's own KV-cache
sampler (rollstream.model.base.BasePolicy.generate); `vllm` is one vLLM engine per producer (engines/vllm.py).
Both are GeneratingPolicies the agent loops (producers/agent.py) drive."""


class EngineStartError(RuntimeError):
    """An engine could not start; the message is one line naming the model path and the cause."""


class EngineError(RuntimeError):
    """A running engine failed (e.g. refused a weight load half-way): the producer exits and is restarted."""
