from django.urls import path

from endpoints.tuning import views

urlpatterns = [
    path("tunings/<int:tuning_id>/", views.tuning_detail, name="tuning_detail"),
    path("tunings/<int:tuning_id>/status", views.tuning_status, name="tuning_status"),
    path("tunings/<int:tuning_id>/apply", views.tuning_apply, name="tuning_apply"),
]
