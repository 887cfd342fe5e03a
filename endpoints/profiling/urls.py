from django.urls import path

from endpoints.profiling import views

urlpatterns = [
    path("profiles/compare", views.profile_compare, name="profile_compare"),
    path("profiles/<int:profile_id>/", views.profile_detail, name="profile_detail"),
    path("profiles/<int:profile_id>/status", views.profile_status, name="profile_status"),
    path("profiles/<int:profile_id>/delete", views.profile_delete, name="profile_delete"),
    path("profiles/<int:profile_id>/files.zip", views.profile_archive, name="profile_archive"),
    path("profiles/<int:profile_id>/files/<path:name>", views.profile_file, name="profile_file"),
]
