from django.apps import AppConfig


class EndpointsConfig(AppConfig):
    name = "endpoints"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self):
        # The registry asks serving for these facts through hooks it defines (it never imports endpoints).
        from endpoints import quantize_check, registry_facts
        from models_registry import hooks
        from models_registry.quantize import serving_check

        hooks.register_artifact_users(registry_facts.artifact_users)
        hooks.register_live_device_memory(registry_facts.live_device_memory)
        serving_check.register(quantize_check.EngineServer)
