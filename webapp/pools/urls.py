from django.urls import path

from webapp.pools import views

app_name = "pools"

urlpatterns = [path("pools/", views.pools, name="pools")]
