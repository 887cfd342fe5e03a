from console.roles import ADMIN, OPERATOR, has_role, user_role


def roles(request):
    user = getattr(request, "user", None)
    return {
        "role": user_role(user),
        "is_operator": has_role(user, OPERATOR) if user else False,
        "is_admin": has_role(user, ADMIN) if user else False,
    }
