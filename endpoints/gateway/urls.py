from django.urls import path

from endpoints.gateway import views

urlpatterns = [
    path("gateway/", views.key_list, name="gateway_key_list"),
    path("gateway/keys/create", views.key_create, name="gateway_key_create"),
    path("gateway/keys/<int:key_id>/", views.key_detail, name="gateway_key_detail"),
    path("gateway/keys/<int:key_id>/revoke", views.key_revoke, name="gateway_key_revoke"),
    path("gateway/keys/<int:key_id>/limits", views.key_limits, name="gateway_key_limits"),
    path("gateway/endpoints/<int:endpoint_id>/bluegreen", views.endpoint_bluegreen, name="gateway_bluegreen"),
    path("gateway/endpoints/<int:endpoint_id>/rollout", views.endpoint_rollout, name="gateway_rollout"),
]
