from django.apps import AppConfig


class EndpointsConfig(AppConfig):
    name = "endpoints"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self):
        # The node agent and telemetry sit below endpoints: serving registers itself with them.
        from django.db.models.signals import post_delete

        from endpoints.commands.container import probe_container_command
        from endpoints.gateway.selectors import budget_teams, key_teams
        from endpoints.models import Endpoint
        from endpoints.reconcile import ReplicaWorkload
        from endpoints.telemetry import (
            collect_replicas,
            endpoint_names,
            endpoint_teams,
            forget_endpoint_telemetry,
            served_facts,
        )
        from workers.agent.workloads import register_workload
        from workers.engine_info import register_image_runner
        from workers.telemetry.sources import (
            register_budget_teams,
            register_collector,
            register_endpoint_names,
            register_endpoint_teams,
            register_key_teams,
            register_served_facts,
        )

        register_workload("endpoints", ReplicaWorkload())
        register_image_runner(probe_container_command)  # a containerised node's engine is probed in its image
        register_collector("endpoints", collect_replicas)
        register_served_facts(served_facts)
        register_endpoint_names(endpoint_names)
        post_delete.connect(forget_endpoint_telemetry, sender=Endpoint, dispatch_uid="endpoints.forget_telemetry")
        register_key_teams(key_teams)  # per-key series and /metrics labels: the key's team's to read
        register_budget_teams(budget_teams)  # a budget's alerts: its team's (a key's budget: the key's team's)
        register_endpoint_teams(endpoint_teams)  # an endpoint's series, alerts and fleet figures: its team's
        # Defining the job kind registers it with the job runtime (workers.jobs).
        # The registry asks serving for these facts through hooks it defines (it never imports endpoints).
        from endpoints import quantize_check, registry_facts
        from endpoints.bench import jobs  # noqa: F401
        from endpoints.gateway.controller import register_evaluator
        from endpoints.profiling import jobs as profiling_jobs  # noqa: F401
        from endpoints.tuning import jobs as tuning_jobs
        from models_registry import hooks
        from models_registry.quantize import serving_check

        register_evaluator(tuning_jobs.sweep_trial_replicas)  # a tuning's leftover trial replicas, once stopped
        hooks.register_artifact_users(registry_facts.artifact_users)
        hooks.register_live_device_memory(registry_facts.live_device_memory)
        hooks.register_launch_refusal(registry_facts.launch_refusal)
        hooks.register_target_engine_versions(registry_facts.target_engine_versions)
        serving_check.register(quantize_check.EngineServer)
