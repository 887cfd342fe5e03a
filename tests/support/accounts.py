"""Test users: one password for every persona."""

from django.contrib.auth import get_user_model

from console.roles import set_role

PASSWORD = "correct horse battery staple 42"


def make_user(username, role):
    user = get_user_model().objects.create_user(username=username, password=PASSWORD)
    if role:
        set_role(user, role)
    return user
