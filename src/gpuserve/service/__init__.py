"""The inference service: the layer between the front ends (``server/``) and the engine and
model repository.

It owns admission (:mod:`~gpuserve.service.inference`), the read views every front end encodes
(:mod:`~gpuserve.service.views`), the typed repository commands
(:mod:`~gpuserve.service.commands`), the access log (:mod:`~gpuserve.service.outcome`), and the
checks of what clients send (:mod:`~gpuserve.service.names`, :mod:`~gpuserve.service.auth`).
Front ends only translate their wire to these calls and the results back.
"""
