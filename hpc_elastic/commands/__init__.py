"""The command layer: one thin module per command, a Typer signature and a call into the domain.

``cli`` registers ``submit`` (also ``render``) at import and loads the others lazily. The domain
sits below: ``hpc_elastic.submission``, ``hpc_elastic.local``, ``hpc_elastic.ops`` and
``hpc_elastic.doctor``; the options ``submit`` and ``run`` share come from
``hpc_elastic.options``. The agent's command stays in ``hpc_elastic.agent.command``.
"""
