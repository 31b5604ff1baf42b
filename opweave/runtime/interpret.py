"""An op-by-op interpreter of a `RankProgram`: the same work as the generated module, dispatched
through Python per operator, with the values of a stage looked up by name in a dictionary.

It exists as the baseline of `bench/runtime.py` (generated straight-line code vs interpretation)
and as a second path that must agree with the generated code.
"""

from __future__ import annotations

import re

from opweave.ir.program import RankProgram, stateful

_VALUE = re.compile(r"^(?P<name>[^\[]+)(\[(?P<index>\d+)\])?$")


class InterpretedProgram:
    """Drop-in for the generated `Program`: `round()` runs one decode step of every microbatch."""

    def __init__(self, rt, program: RankProgram):
        self.rt = rt
        self.program = program
        self.state = {l.op: rt.state_views(l.op) for st in program.stages for l in st.launches if stateful(l)}

    @staticmethod
    def _get(env: dict, value: str):
        m = _VALUE.match(value)
        if m.group("name") in env:
            out = env[m.group("name")]
            return out if m.group("index") is None else out[int(m.group("index"))]
        return env[value]

    def round(self) -> None:
        rt = self.rt
        held: list[dict] = [{} for _ in range(self.program.num_microbatches)]  # kept between stage programs
        for st in self.program.stages:
            for mb in range(self.program.num_microbatches):
                if not rt.live(st.stage, mb):
                    continue
                env: dict = {}
                if st.recv is None:
                    env["ids"], env["positions"] = rt.begin(mb)
                else:
                    env["positions"], values = rt.recv(st.stage, mb)
                    env.update(zip(st.recv.values, values))
                env.update((v, held[mb][v]) for v in st.takes)
                for launch in st.launches:
                    args = [self._get(env, v) for v in launch.inputs]
                    if launch.kind == "sample":
                        out = rt.sample(mb, *args, env["positions"])
                    elif launch.op in self.state:  # a stateful op: its state for this microbatch
                        out = rt.ops[launch.op](*args, state=self.state[launch.op][mb])
                    else:
                        out = rt.ops[launch.op](*args)
                    if launch.allreduce:
                        out = rt.allreduce(out)
                    env[launch.output] = out
                held[mb].update((v, self._get(env, v)) for v in st.keeps)
                if st.send is not None:
                    rt.send(st.stage, mb, env["positions"], tuple(self._get(env, v) for v in st.send.values))
                elif st.returns:
                    rt.finish(mb, env[st.launches[-1].output])
