from drf_spectacular.extensions import OpenApiAuthenticationExtension


class APIKeyAuthScheme(OpenApiAuthenticationExtension):
    target_class = "webapp.accounts.auth.APIKeyAuthentication"
    name = "ProjectKey"

    def get_security_definition(self, auto_schema):
        return {
            "type": "http",
            "scheme": "bearer",
            "bearerFormat": "sk-steep-…",
            "description": "A project API key.",
        }
