from django.urls import path

from models_registry.quantize import views

urlpatterns = [
    path("artifacts/<int:artifact_id>/quantize", views.artifact_quantize, name="artifact_quantize"),
    path("calibration/", views.calibration_list, name="calibration_list"),
    path("calibration/upload", views.calibration_upload, name="calibration_upload"),
    path("calibration/<int:dataset_id>", views.calibration_detail, name="calibration_detail"),
    path("calibration/<int:dataset_id>/delete", views.calibration_delete, name="calibration_delete"),
]
